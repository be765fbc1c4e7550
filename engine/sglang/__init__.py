"""The client side of SGLang's `/generate`: requests out, replies in, errors classified.

Membership: code that knows the wire format or talks HTTP to a server or router, and the one
client every HTTP call of the engine goes through (an environment's service, `run`'s checks
included). The embedded server's side of the same format lives in `engine.local.server`.
"""

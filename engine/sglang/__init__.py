"""The client side of SGLang's `/generate`: requests out, replies in, errors classified.

Membership: code that knows the wire format or talks HTTP to a server or router. The embedded
server's side of the same format lives in `engine.local.server`.
"""

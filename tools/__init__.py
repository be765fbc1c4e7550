"""Tools the model can call, registered by name. Importing this package registers the built-ins."""

from tools.registry import Tool, ToolError, ToolResult, check_arguments, get, names, register, tool, unregister

__all__ = ["Tool", "ToolError", "ToolResult", "check_arguments", "get", "names", "register", "tool", "unregister"]

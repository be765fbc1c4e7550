"""Helpers shared by the tests: scripted servers, episodes, a plug-in tool module."""

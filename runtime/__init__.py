"""Draft-and-verify at run time: the target on llama.cpp, draft heads, decoding, the app API.

Imports neither torch nor transformers, so an app can embed it with the base install.
"""

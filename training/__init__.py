"""Training draft heads: target-written data, hidden-state features, the torch head, the loop.

Needs the `train` extra (torch, transformers); nothing in the runtime imports this package.
"""

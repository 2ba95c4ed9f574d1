"""Bounds on manifest and CLI numbers, in a module that imports nothing: every command's
start-up reads them (option bounds), and must not load the manifest, layout and plan chain."""

MAX_AXIS = 2**20  # a mesh axis degree (tp, pp, dp, ep, cp), nodes, GPUs per node
MAX_DIM = 2**32  # one model dimension or token count

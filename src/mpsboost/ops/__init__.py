"""Backing kernels: one function per operation, choosing its path by device and torch version.

``ops`` never imports diffusers or transformers.
"""

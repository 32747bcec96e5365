"""Built-in tasks: offline, download-free, with a gold score apart from any learned reward model.

``digits`` (:mod:`proximal.tasks.digits`) — sort a string of digits. The demo (``proximal demo``)
runs the whole of RLHF on it; see docs/demo.md.
"""

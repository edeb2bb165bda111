"""Training: the one loop (:mod:`.loop`), its jobs, methods, distribution strategies, run folders and checkpoints."""

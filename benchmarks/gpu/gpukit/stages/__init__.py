"""The kit's stages, one module each (``setup``, ``perf``, ``correctness``, ``speed``, ``quality``): every
module's ``steps(ctx)`` lists its steps for this call; ``gpukit.cli.STEP_BUILDERS`` maps the stage names to them."""

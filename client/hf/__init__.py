"""The Hugging Face hall: site hooks on transformers MoE models (``HFSiteHooks`` and their layouts),
``FP4SiteRecorder`` for a rollout through ``generate()``, ``GuidedFP4Hooks`` for training and the
torchao NVFP4 QAT adapter. Works with a recorder or a reader handed to it; imports the core only."""

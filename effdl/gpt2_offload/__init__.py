"""What the GPT-2 offload scripts (memory_efficient_gpt2/) share: the run's typed config and
flags (:mod:`.config`), its model and batches (:mod:`.inputs`), timed steps under memory caps
(:mod:`.steps`), the AdamW reference run (:mod:`.reference`) and the GPU/host budget beside the
measured peaks (:mod:`.budget`)."""

"""What the GPT-2 offload scripts (memory_efficient_gpt2/) share: the run's typed config and
flags (:mod:`.config`), its model and batches (:mod:`.inputs`), timed steps under memory caps
(:mod:`.steps`), the offloaded run's set-up, steps and summary (:mod:`.run`), the AdamW
reference run (:mod:`.reference`), the plain forward+backward baselines (:mod:`.baseline`), the
GPU/host budget beside the measured peaks (:mod:`.budget`), held-out loss and prompt
continuations (:mod:`.evaluate`), and the data of a fine-tune on code (:mod:`.code_data`)."""

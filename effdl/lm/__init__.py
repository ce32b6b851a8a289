"""Set-up of a language-model training run, shared by the LM task scripts.

:mod:`effdl.lm.processes` (this process's rank and device, the process group),
:mod:`effdl.lm.build` (the Llama on its device, attention backend, AdamW),
:mod:`effdl.lm.data` (corpus, tokenizer, per-rank batches), :mod:`effdl.lm.loss` (token loss,
held-out loss), :mod:`effdl.lm.throughput` (tokens/s, TFLOP/s, MFU), :mod:`effdl.lm.tracing`
(torch.profiler ranges), and :mod:`effdl.lm.stages` (the stages of the speed-up study and the
step each one runs).
"""

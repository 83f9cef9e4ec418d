"""Accuracy and prefill throughput of ``minimax_m3``'s sparse attention against dense attention on the same model.

Commands:

* ``python -m eval`` — the main job: accuracy on the shipped trained tiny model, throughput on the embedded random
  one (CPU-sized);
* ``python -m eval.accuracy`` (``minimax-m3-accuracy``) — lm-eval in sparse and dense mode side by side, with
  the paired exact McNemar test, the logit agreement on long inputs and retrieval accuracy per context length;
* ``python -m eval.retrieval_accuracy`` (``minimax-m3-retrieval-accuracy``) — retrieval accuracy per context length
  for dense, sparse (FP8 / bf16 index path), an untrained indexer and a sliding window, with recall;
* ``python -m eval.throughput`` (``minimax-m3-throughput``) — prefill tokens/s, TTFT, peak memory and speed-up
  over dense for fresh and chunked prefills, and one sparse layer's attention against dense.

Modules: ``modes`` (switching a model between sparse / sparse-torch / dense), ``default_model`` (the embedded
tiny model and tokenizer), ``tasks`` (bundled offline lm-eval tasks), ``stats`` (McNemar, spreads),
``logit_agreement``, ``timing``, ``report`` (tables, JSON, plot), ``offline`` (the Hugging Face offline switches).

Training a tiny model whose indexer matters (docs/TRAINING.md): ``python -m eval.train_tiny``
(``minimax-m3-train-tiny``; the shipped result is ``trained_model``, its curves ``training_curves``), with
``synthetic_retrieval`` (the long-context retrieval data), ``indexer_distillation`` (the indexer's KL objective),
``recall`` (the share of dense attention mass in the selected pages) and ``layer_inputs`` (capturing what the sparse
layers saw).

``eval`` imports ``minimax_m3`` and ``indexer``, never the other way round.
"""

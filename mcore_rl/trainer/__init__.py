"""The rank side of training: the Megatron roles' ranks (:mod:`~mcore_rl.trainer.ranks`, ``policy``, ``value``),
the train step and model wrapper (``training``), packing, log-probs, MoE router statistics, offload, and the weight
sync to the engines (``sync``). The driver's handles to them live in :mod:`mcore_rl.roles`."""

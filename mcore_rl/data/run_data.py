"""A run's prompts (:class:`Data`): the tokenised train set in its seeded order and the named eval sets."""

from __future__ import annotations

import logging

from mcore_rl.config.loader import ConfigError
from mcore_rl.config.model_checks import load_tokenizer
from mcore_rl.config.schema import RunConfig
from mcore_rl.data.arithmetic import BUILTIN_SPLITS
from mcore_rl.data.prompts import PromptDataset, read_rows

log = logging.getLogger(__name__)


class Data:
    """Tokenised train and eval prompts; the train order is seeded and its position is saved in checkpoints.

    Built before a run writes anything: a file that cannot be read, or that leaves no usable prompt, is a
    ``ConfigError`` naming its key.
    """

    def __init__(self, config: RunConfig):
        rt, policy = config.runtime_args, config.models.policy
        self.tokenizer = load_tokenizer("models.policy.load", policy.load)
        self.train = self._prompts("runtime_args.data_path", rt.data_path, 0, config, rt.data_shuffle)
        # the eval sets by name, the main one ("") first
        sets = {"": ("runtime_args.eval_data_path", rt.eval_data_path)}
        sets |= {name: (f"runtime_args.eval_sets.{name}", path) for name, path in rt.eval_sets.items()}
        self.eval = {name: self._prompts(key, path, 1, config, False) for name, (key, path) in sets.items()}

    def _prompts(self, key: str, path: str, split: int, config: RunConfig, shuffle: bool):
        rt = config.runtime_args
        try:
            if path in BUILTIN_SPLITS:
                rows = BUILTIN_SPLITS[path](rt.num_builtin_train, rt.num_builtin_eval, rt.seed)[split]
            else:
                rows = read_rows(path)
            prompts = PromptDataset(rows, self.tokenizer, config.models.policy.max_prompt_tokens, rt.seed, shuffle)
        except (ValueError, OSError) as err:
            raise ConfigError(f"{key}={path!r}: {err}") from None
        if prompts.dropped:
            log.warning("%s: %d prompts longer than max_prompt_tokens dropped", key, prompts.dropped)
        return prompts

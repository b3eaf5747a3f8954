"""The options generate.py and serve.py share (which model, how a pruned one runs), apart from
the loading they steer, so that a script's --help needs neither torch nor the model.
"""
from dataclasses import dataclass

from config import Config, opt

SPARSE_MODES = ("dense", "sparse", "auto")


@dataclass
class InferenceOptions:
    """The command-line options generate.py and serve.py share: which model, and how a pruned
    one runs. The rest of what loading reads is the config (sample.checkpoint, sample.weights,
    sample.quantize, sample.weight_layout, system.device ...)."""

    init_from: str = opt("", "the model: gpt2[-medium|-large|-xl] | hf:ORG/NAME | a local HF "
                         "dir | our checkpoint; default: sample.checkpoint, else train.out_dir")
    sparse: str = opt("auto", "a pruned checkpoint (prune.py): auto = sparse kernels for the "
                      "weight shapes a timing probe finds faster here (generate.py: at one row, "
                      "as decoding; serve.py: at --slots rows) | sparse | dense (its weights "
                      "with zeros)", SPARSE_MODES)

    def model_source(self, cfg: Config) -> str:
        """--init-from, else sample.checkpoint, else train.out_dir."""
        if self.init_from in ("", "resume", "auto"):
            return cfg.sample.checkpoint or cfg.train.out_dir
        return self.init_from

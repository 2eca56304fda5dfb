"""The EAGLE-3 draft, one concern per file:

* ``config.py``: :class:`Eagle3Config` parsed from each checkpoint format's ``config.json``, the RoPE
  settings and the default tap layers (plain Python);
* ``checkpoint.py``: strict reading and writing of checkpoint directories (safetensors, sharded, or
  ``pytorch_model.bin`` read with ``weights_only=True``), key names normalised to SafeAILab's;
* ``module.py``: RoPE and the draft module :class:`Eagle3Draft`, whose ``from_pretrained`` /
  ``save_pretrained`` go through ``checkpoint.py``.

Imports go config <- checkpoint <- module; this file re-exports the public names.
"""
from .config import Eagle3Config, default_tap_layers
from .module import Eagle3Draft, rope_inv_freq

__all__ = ["Eagle3Config", "Eagle3Draft", "rope_inv_freq", "default_tap_layers"]

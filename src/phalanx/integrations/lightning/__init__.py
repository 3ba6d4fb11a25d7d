"""phalanx under Lightning: `PhalanxStrategy` for `lightning.Trainer` and `lightning.Fabric`.

    pip install 'phalanx[lightning]'

    import lightning as L
    from phalanx.integrations.lightning import PhalanxStrategy

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PhalanxStrategy("zero3"))

Importing it also does two things for Lightning, in this process:
- registers phalanx's strategy names in Lightning's registries (registry.py), so that
  `L.Trainer(strategy="phalanx_zero3")` and `L.Fabric(strategy="phalanx")` work;
- lets `LightningModule.load_from_checkpoint(path)` read the checkpoint directories written
  under PhalanxStrategy (checkpoints.py).

It needs the `lightning` package (`import lightning`); the standalone `pytorch_lightning`
package has classes of its own, which its Trainer checks strategies against.
"""

try:
    import lightning  # noqa: F401
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "phalanx.integrations.lightning needs Lightning: pip install 'phalanx[lightning]' "
        "(or pip install lightning)") from exc

from .checkpoints import read_directories_in_lightning
from .registry import register_everywhere
from .strategy import PhalanxStrategy

register_everywhere(PhalanxStrategy)
read_directories_in_lightning()

__all__ = ["PhalanxStrategy"]

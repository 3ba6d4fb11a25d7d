"""phalanx under Lightning: `PhalanxStrategy` for `lightning.Trainer` and `lightning.Fabric`.

    pip install 'phalanx[lightning]'

    import lightning as L
    from phalanx.integrations.lightning import PhalanxStrategy

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=PhalanxStrategy("zero3"))

It needs the `lightning` package (`import lightning`); the standalone `pytorch_lightning`
package has classes of its own, which its Trainer checks strategies against.
"""

try:
    import lightning  # noqa: F401
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "phalanx.integrations.lightning needs Lightning: pip install 'phalanx[lightning]' "
        "(or pip install lightning)") from exc

from .strategy import PhalanxStrategy

__all__ = ["PhalanxStrategy"]

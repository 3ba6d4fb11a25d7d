"""What `px.prepare` does to a model, and the module it returns.

- `prepare`: `px.prepare` and the verbs on a prepared model (`no_sync`, `clip_grad_norm_`,
  `unwrap`, `step_stats`, `optimizer_state_dict`): the order of what is done, and why.
- `prepared`: `PreparedModule`, the user's module plus what happens around each forward.
- `precision`: compute, communication and output dtypes; `loss_scaling`: fp16's loss scale and
  the gate every output passes.
- `materialize`: a model built on the meta device given storage and its initial values.
- `consistency`: every rank starts from the same model, or is told precisely why not.
- `sync_batchnorm`: BatchNorm statistics over all ranks.

(No name is re-exported here: `phalanx.model.prepare` stays the module, and `px.prepare` the
function.)
"""

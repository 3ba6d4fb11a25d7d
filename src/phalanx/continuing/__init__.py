"""Training through a failure without a restart: `phalanx run --on-failure continue`.

When a worker dies (killed, crashed, its machine gone), the others notice within the step,
form a group without it and redo the step in flight with the same global batch split over
fewer ranks; its agent starts a replacement, which runs the script from the top and joins at
the others' next `px.save`, loading their live state. Nobody else restarts, imports again or
reloads anything.

The package stands above the engine, the model, the data and checkpoints, which it imports;
they reach continue mode through comm/continuation.py (`now()`: this process's one
`Continuation`, whose methods are the calls they make of it; and `install`, px.init's way in)
and comm/gate.py (the switch every collective reads: the step in flight is lost), the parts of
it below them, so no import runs back up a floor. By role:
    store.py       the keys the agents and workers share in the job's store
    membership.py  generations: who is in, forming a new group ([Note: generations])
    steps.py       the step boundary: the vote, the recovery decision, the redo
                   ([Note: the commit vote])
    gathers.py     an evaluation's gathers voted on, its batch in flight redone
                   ([Note: an evaluation redone])
    joining.py     a replacement: waiting, admission at a px.save, loading the live state
    events.py      one console line, a step-report event and a metrics row per change
    session.py     `Session`: the above as one object for this process, answering the
                   floors below; `start` makes it (installed by phalanx/__init__)

Only `phalanx run --on-failure continue` turns it on (PHALANX_ON_FAILURE=continue, read by
`px.init`); otherwise nothing here runs and a failure ends the job as before.
"""

from ..comm.continuation import ON_FAILURE, Continuation, MembershipError, continuing, now, wanted

__all__ = ["Continuation", "now", "continuing", "wanted", "MembershipError", "ON_FAILURE"]

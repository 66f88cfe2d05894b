"""The core: a step's events checked and queued, planned into stages, sent to the other ranks and run on
the pool, one flush at a time; and the values it is made of (spec, pool, ledgers, events, errors).

::

    _errors       MambaCacheError          the one error hierarchy
    _events       Alloc ... StepReport     the events (frozen values) and a step's report
    _spec         StateSpec                shapes and dtypes of one slot
    _hfconfig     spec_kwargs_from_config  a StateSpec's fields from a transformers config
    _pool         StatePool                the tensors (own or adopted), slot 0 = padding
    _layout       layer_groups             per-layer tensors as layer groups
    _indices      StateIndices             a fixed-address request -> slot index tensor for kernels
    _ledger       SlotLedger               held slots, tenants, the free heap, a batch's checks
    _lifecycle    Lifecycle                a manager's one phase, and why it broke
    _backlog      Backlog                  device work taken but not finished; work done (tickets)
    _validate     check_*                  the argument checks, one rule per kind
    _planner      plan_step                a step's events -> the fewest stages (pure Python)
    _runner       StepRunner               a stage through the executor on every tensor; the failure budget
    _channel      Channel                  how a plan reaches the other ranks; LoopbackChannel
    _distributed  DistributedChannel       the Channel over torch.distributed (gloo)
    _queue        StepQueue                the event queue under the lock; the SubmitGuard a layer plugs in
    _flush        FlushCore                one flush at a time: take, plan, send/receive, run
    _worker       run_in_worker            a blocking call in a worker thread, waited for to its end
    _tracer       Tracer                   the one hook the core reports to (tracing/ installs a LogTracer)
    _torchutil    as_device                small torch helpers the core shares

The executors that run its stages are ``_executors/``. The core imports no layer above it (the tiers,
the hand-off, the manager, a tool: ``tests/package/test_layers.py``); where it must consult one it defines the
protocol (the queue's ``SubmitGuard``). Nothing is imported on import of the folder itself.
"""

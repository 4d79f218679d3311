"""The process runtime around the training loop: processes, hangs, wall time, injected faults.

  distributed.py  `jax.distributed` from the environment (explicit, SLURM, JAX's detection), the
                  barriers, and one error line per process when a job fails
  health.py       the watchdog: hangs and stragglers, with a report of every thread's stack
  goodput.py      where a run's wall time went across restarts (run_dir/goodput.jsonl, `shardtrain goodput`)
  faults.py       fault injection for tests (SHARDTRAIN_FAULT: nan, hang, kill, lose at a step)
  preemption.py   SIGTERM and Ctrl-C: save at the next step boundary, or stop at once before the first step
  rundir.py       one trainer per run dir: run_dir/.lock, held by process 0 for the run's life

The package imports only config/ and chips: nothing here knows the model, the mesh or the step.
"""

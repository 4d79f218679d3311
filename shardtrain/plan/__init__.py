"""Planning a mesh without running it: `shardtrain plan` and `shardtrain plan --search`.

- `planner`: one mesh. Builds the trainer's own step (`step.build`), lowers it from abstract inputs,
  compiles it for the target devices and reports memory, collectives, FLOPs and a roofline.
- `search`: every mesh of N devices, pruned by the abstract state's bytes, compiled in a thread
  pool and ranked by the planner's estimate.
- `topology`: compile-only devices of a TPU slice (libtpu), to compile for TPUs on any machine.
- `hlo`: reading the compiled program's text (parse / cost / collectives).

The package builds on the step builder (step, parallel/, config) and the chip table
(shardtrain/chips.py: the accelerators' figures the roofline divides by), and nothing above them:
it imports nothing from the training loop.
"""

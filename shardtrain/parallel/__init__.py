"""How a mesh is used: every way the trainer splits a model and its data over devices.

Modules, lower first:
  mesh.py       the device mesh from the mesh config (axis sizes, -1, hybrid ICI x DCN placement)
  sharding.py   logical axis names -> PartitionSpecs through the rules table; a model's parameter
                layout (`param_layout`); `Constrain` and `Shard`, what a model gets to constrain its
                activations and run per-device code (models/contract.py is the interface)
  blocks.py     the layer scan over a model's stacked blocks, each layer rematerialised by train.remat
  pipeline.py   pipeline parallelism over the `pipeline` axis (GPipe, circular)
  comm.py       less communication over the replica axes: compressed gradient reduction, local SGD

The package imports only config/, chips and models/; the step builder (shardtrain/step.py) puts
these pieces together.
"""

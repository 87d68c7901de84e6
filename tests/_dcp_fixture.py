"""The cases of the torch.distributed.checkpoint fixtures (tests/fixtures/dcp): shared by the script that writes
them with FSDP2 and the tests that load them into zerocore. The model, data and loss are the DeepSpeed
fixtures' (tests/_ds_fixture.py)."""

from __future__ import annotations

# name -> how the run is saved ("layout"), whether FSDP2 computes in bf16 over fp32 parameters, and whether
# the parameters are split in two param groups (no weight decay on the one-element scale and the biases)
#   tutorial:   dcp.save({"model": ..., "optim": ...}) of get_state_dict(model, optimizer), as torch's DCP recipe
#   torchtitan: the model's keys at the top level, the optimizer flattened (flatten_optimizer_state_dict=True)
#               under "optimizer", with "lr_scheduler" and "train_state" beside them
#   accelerate: Accelerate's FSDP2 SHARDED_STATE_DICT: pytorch_model_fsdp_0/ holds {"model": ...} and
#               optimizer_0/ holds {"optimizer": ...}, two DCP directories in one checkpoint folder
CASES: dict[str, dict] = {
    "tutorial-fp32-groups": {"layout": "tutorial", "bf16": False, "groups": True},
    "torchtitan-bf16": {"layout": "torchtitan", "bf16": True, "groups": False},
    "accelerate-fp32": {"layout": "accelerate", "bf16": False, "groups": False},
}
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
STEPS = 3  # saved after this many optimizer steps; the tests take the next one

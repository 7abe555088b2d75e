"""The toy family's registry entry: import this module (or name it in BATON_FAMILY_MODULES)."""

from baton.model.family import FamilySpec, Weights, register

MODULE = __name__
"""What BATON_FAMILY_MODULES names for worker processes."""

SPEC = register(FamilySpec(
    name="toy_dense",
    model_types=("toy_dense",),
    config="tests.support.toy_family.config:ToyConfig",
    model="tests.support.toy_family.model:ToyModel",
    stage="tests.support.toy_family.model:ToyStage",
    weights=Weights(embeddings="backbone.embeddings.weight"),
    make="tests.support.toy_family.make:write_checkpoint",
    moe_experts_field="n_routed_experts",
))

"""The toy family's model and pipeline stage: NemotronH's blocks, unchanged."""

from baton.model.nemotron_h.model import NemotronHModel
from baton.model.nemotron_h.stage import StageModel


class ToyModel(NemotronHModel):
    pass


class ToyStage(StageModel):
    pass

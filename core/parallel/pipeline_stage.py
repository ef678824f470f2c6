"""torch.distributed.pipelining's part of pipeline parallelism (posttrain.core.parallel.pipeline):
the schedules by name and the stage class. Its own module because importing torch's pipelining
imports torch._dynamo and inductor (0.7 s): build_pipeline imports it, so a process that does not
split its model into stages never pays that."""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining._utils import InferenceMode

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


class AccumulatingStage(PipelineStage):
    """torch's PipelineStage, keeping the gradients accumulated in an optimizer step when a
    forward-only (eval) schedule step comes between its micro-batches, as DPO's `reference:
    disable_adapter` runs one before each. torch 2.13 loses them twice there: each switch
    between eval and training re-prepares the stage and then sets every FSDP parameter's .grad to
    None (to drop what a metadata-inference forward and backward left, but this stage is given
    its shapes, `_stage_metas`, so no such pass ran), and the eval step ends with FSDP's
    post-backward and the gradient scaling, as if it had run a backward. Seen as a gradient norm
    0.72x one process's under PP x FSDP (and PP x CP, FSDP over the cp ranks) with 2 accumulated
    micro-batches (tests/core/parallel/test_pipeline_parallel.py)."""

    def _post_metadata_inference_cleanup(self) -> None:
        if self._inference_mode == InferenceMode.DYNAMIC:
            super()._post_metadata_inference_cleanup()

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if self.has_backward:
            super().perform_reduce_grad(grad_scale_factor)
            return
        for module in self.submod.modules():  # forward only: free what it gathered, reduce nothing
            if isinstance(module, FSDPModule):
                module.reshard()

"""MLflow tracking from rank 0: the pipeline run is the parent, each stage a child run.

`create_tracker` gives rank 0 a `Tracker` and every other rank a `NullTracker` with the same
methods. A Tracker never blocks or crashes training on MLflow: log_* calls only append to
in-memory buffers, and one background thread delivers them (MlflowClient.log_batch, chunked to
MLflow's batch limits). When the tracking server is unreachable or a call raises, the buffers are
kept (metrics bounded, the oldest dropped and counted), a warning is logged once per outage, and
delivery is retried with exponential backoff. close() makes a final flush with a timeout.
MLflow's own HTTP retries (MLFLOW_HTTP_REQUEST_MAX_RETRIES, default 7, exponential) happen
inside one delivery attempt; lowering them lets this backoff take over sooner.

Only MlflowClient is used, never the fluent API: its active-run stack is process- (and thread-)
global, while a Tracker is an object (tests run several). Code that wants a fluent run, e.g. to
log a LoggedModel, can `mlflow.start_run(run_id=tracker.run_id)`. A child in another process
(a torchrun stage under the pipeline flow) finds its parent in `parent_run_id` or the env
POSTTRAIN_PARENT_RUN_ID / MLFLOW_PARENT_RUN_ID and is created with the `mlflow.parentRunId` tag,
which is how MLflow nests runs (what `mlflow.start_run(nested=True)` does in one process).

    config.py   TrackingConfig
    params.py   configs as MLflow params (flattened, truncated, secrets masked)
    tracker.py  Tracker (rank 0, buffered, never blocks training), NullTracker, create_tracker,
                open_run (a run opened now, resumed by id by a later process)
"""

from posttrain.core.tracking.config import TrackingConfig
from posttrain.core.tracking.params import (MASK, check_artifact_path, clean_key, flatten_params, is_secret_key,
                                  mask_secrets)
from posttrain.core.tracking.tracker import NullTracker, Tracker, create_tracker, open_run

__all__ = ["MASK", "NullTracker", "Tracker", "TrackingConfig", "check_artifact_path", "clean_key",
           "create_tracker", "flatten_params", "open_run", "is_secret_key", "mask_secrets"]

"""An OpenAI-compatible model server on posttrain.core.generation's engine (docs/serving.md).

    worker.EngineWorker   one engine replica, driven by its own thread
    protocol              request checks -> RequestParams; OpenAI-shaped errors
    text                  stop strings and streamed text
    app.build_app         the FastAPI routes, auth, backpressure, metrics
    server                adapters onto the base, the state, uvicorn
    routing.Router        which replica gets a request (least outstanding tokens, or by prompt prefix)
    frontend              --replicas N: the replica processes, their supervisor, the proxying front end
    tp                    --tp K: one replica over K processes, the model split by tensor parallelism
"""

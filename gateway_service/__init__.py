"""The OpenAI-compatible HTTP gateway: a client of the scheduler's gRPC Generation API.

    HTTP client (openai, curl, LangChain, load generators)
        --POST /v1/completions, /v1/chat/completions (JSON; SSE when streaming)-->
    gateway_service (Starlette on uvicorn)  --GenerationService.Generate (gRPC stream)--> scheduler

It imports the ground floor (`sluice`) only: like any client, never the scheduler or a worker.
"""

"""The HTTP shim: Anthropic and OpenAI APIs in front of the scheduler (one process,
`python -m orchestrator.shim.server`; the launcher starts it). Its map:

    server              the Starlette app: routes, error shapes, start-up, command line
    state               ServerState: the engine client, tokenizer, limits, counters
    admission           what a request passes first: key, gate, sizes, counts, headers
    pipeline            serve(): admit -> body -> parse -> engine -> start -> JSON or SSE
    sse                 the one SSE skeleton (opening, keep-alives, errors, close and log)
    anthropic_request   /v1/messages bodies -> ChatRequest
    anthropic_response  messages and their SSE events; the /v1/messages endpoints
    openai_request      chat bodies -> ChatRequest; completions -> GenerateRequest
    openai_response     chat completions and text completions, JSON or SSE; endpoints
    validate            field checks both APIs share
    chat                ChatRequest -> prompt (template, tokens, tool_choice) -> ChatRun
    generation          Generation: GenerateRequest (+ Delivery) -> text pieces, counts
    engine_client       the scheduler's socket: requests out, outputs in
    resume              a request continued on a restarted engine (--restart)
    chat_template, tool_parsers, reasoning, structured_output, detokenizer,
    prefix_tracker, json_body, errors, metrics: what those steps use

The other half of orchestrator/ (launcher, config, self_check, cache_gate) starts and
supervises the processes.
"""

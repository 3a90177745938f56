"""radixserve.lang: SGLang's frontend language against the router's public gRPC API. An SGLang program ports by
changing its import (`from radixserve import lang as sgl`) and its backend line (`sgl.Router("127.0.0.1:50051")`).

    @function
    def multi_turn_question(s, question_1, question_2):
        s += system("You are a helpful assistant.")
        s += user(question_1)
        s += assistant(gen("answer_1", max_tokens=64))
        s += user(question_2)
        s += assistant(gen("answer_2", max_tokens=64))

    set_default_backend(Router("127.0.0.1:50051"))
    state = multi_turn_question.run(question_1="...", question_2="...", temperature=0)
    state["answer_1"], state.messages(), state.cached_tokens

Decisions (where this differs from SGLang, or SGLang leaves a choice):
- The chat template is the router's. A program is plain text (no role segment: calls send `text`) or chat turns
  (every piece inside `system`/`user`/`assistant`: calls send `messages`, templated by the router with the
  generation prompt). A call right after `assistant(` sends exactly the messages so far, so a greedy `gen` returns
  what a client sending those messages to Generate gets. A call after text inside the assistant turn
  (`assistant("Answer: " + gen(...))`) sends token ids: Tokenize of the turns so far, then Tokenize of that text.
  Text outside a turn in a chat program, and calls outside `assistant`, are a ValueError at the `+=`.
  `state.text()` is the text without the template's markup (chat: one turn's content per line);
  `state.messages()` the turns.
- `select(name, choices)` ranks whole choices: each choice's token ids (Tokenize of the choice alone) after the
  prompt's are scored with `prompt_logprobs`, and the highest mean token logprob wins (SGLang's default,
  token_length_normalized; ties: the first). Scoring starts at the choice (`prompt_logprobs_start`), so the
  prompt's cached pages are reused: a select costs about one prefill of the choice's tokens per choice.
- `gen(choices=...)` is the server's constrained decoding (token by token, greedy picks the likeliest first
  token; it reuses the cache), unlike SGLang, where it means `select`; `regex` and `json_schema` likewise.
- Caching on purpose: see `interpreter` (fork and run_batch prime the shared prefix; `state.cached_tokens`).
- Errors: `RouterError` (`.code`, the grpc.StatusCode, and `.details`, the router's message). Images, tools,
  `assistant_begin`/`assistant_end` and SGLang's other backends are not supported.
"""

from radixserve.lang.backend import Completion, Router, RouterError
from radixserve.lang.interpreter import Function, ProgramState, Selection, function, set_default_backend
from radixserve.lang.ir import assistant, gen, select, system, user

__all__ = ["Completion", "Function", "ProgramState", "Router", "RouterError", "Selection", "assistant", "function",
           "gen", "select", "set_default_backend", "system", "user"]

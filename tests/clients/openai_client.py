"""Drives the OpenAI Python SDK, exactly as an application would, against the proxy under test.

Used by tests/openai_sdk.rs: it reads a plan (a JSON list of calls) on stdin and prints one JSON
line per call with what the SDK got back: the `x-dp-rank` response header, the rank the mock
rank reports in the body (`mock.rank` of the completion, or of every streamed chunk) and the
answer's text. The test, not this script, decides what is right.

Each call is one turn of a named conversation (`api`: chat, completions or responses): the script
keeps every conversation's history, as a chat application does (the previous turns and answers
are sent again), and passes the routing
fields as the SDK's own arguments (`prompt_cache_key=`, `user=`, `extra_headers=`), so the
requests are the SDK's unchanged serialisation.

The SDK can reach nothing but the proxy: the base URL must be on 127.0.0.1, the API key is a
dummy, retries are off (a retry could hide a failure), the HTTP client ignores proxy variables
from the environment, and a request hook refuses any other host before a byte is sent.

Usage: openai_client.py BASE_URL < plan.json
"""

import json
import sys
from urllib.parse import urlsplit

try:
    import openai
except ImportError as missing:
    sys.exit(
        f"the OpenAI SDK is not importable ({missing}): `make tools` installs it into "
        ".tools/venv (scripts/install-tools.sh)"
    )

LOOPBACK = "127.0.0.1"


def only_loopback(request):
    """httpx request hook: nothing leaves this machine, whatever the SDK was told."""
    if request.url.host != LOOPBACK:
        raise RuntimeError(f"refusing a request to {request.url}: only {LOOPBACK} is allowed")


def client(base_url):
    if urlsplit(base_url).hostname != LOOPBACK:
        sys.exit(f"base URL {base_url!r} is not on {LOOPBACK}")
    http_client = openai.DefaultHttpxClient(
        trust_env=False, event_hooks={"request": [only_loopback]}
    )
    return openai.OpenAI(
        base_url=base_url,
        api_key="dummy-key-for-the-mock",
        organization=None,
        project=None,
        max_retries=0,
        timeout=30.0,
        http_client=http_client,
    )


def mock_rank(obj):
    """The rank the mock wrote into a completion or a chunk (an extra field the SDK keeps)."""
    extra = obj.model_extra or {}
    return (extra.get("mock") or {}).get("rank")


class Conversation:
    """The history a client resends on every turn."""

    def __init__(self):
        self.messages = []  # chat
        self.prompt = ""  # completions: the transcript so far
        self.items = []  # responses: the input items so far, answers as the SDK returned them

    def chat_request(self, say):
        self.messages.append({"role": "user", "content": say})
        return {"messages": list(self.messages)}

    def completion_request(self, say):
        self.prompt += f"User: {say}\nAssistant:"
        return {"prompt": self.prompt}

    def answered(self, api, text):
        if api == "chat":
            self.messages.append({"role": "assistant", "content": text})
        else:
            self.prompt += f" {text}\n"


def text_of(api, choice, streamed):
    if api == "completions":
        return choice.text or ""
    part = choice.delta if streamed else choice.message
    return part.content or ""


def call_responses(sdk, step, conversation, kwargs):
    """One turn on the Responses API, as the OpenAI Agents SDK sends it without server-side
    state: every earlier item again, the answer's output items as the SDK parsed them
    (`model_dump(exclude_unset=True)`, ids and status included), the instructions each time."""
    conversation.items.append({"role": "user", "content": step["say"]})
    if "instructions" in step:
        kwargs["instructions"] = step["instructions"]
    raw = sdk.responses.with_raw_response.create(
        model="mock", input=list(conversation.items), max_output_tokens=8, **kwargs
    )
    parsed = raw.parse()
    conversation.items.extend(item.model_dump(exclude_unset=True) for item in parsed.output)
    return {
        "label": step["label"],
        "status": raw.status_code,
        "header_rank": raw.headers.get("x-dp-rank"),
        "body_ranks": [mock_rank(parsed)],
        "text": parsed.output_text,
    }


def call(sdk, step, conversation):
    api = step["api"]
    stream = bool(step.get("stream", False))
    if api == "responses":
        return call_responses(sdk, step, conversation, dict(step.get("kwargs", {})))
    if api == "chat":
        resource, body = sdk.chat.completions, conversation.chat_request(step["say"])
    elif api == "completions":
        resource, body = sdk.completions, conversation.completion_request(step["say"])
    else:
        raise ValueError(f"unknown api {api!r}")
    # Routing fields as the SDK's own keyword arguments (prompt_cache_key=, user=, ...).
    kwargs = dict(step.get("kwargs", {}))
    if "extra_headers" in step:
        kwargs["extra_headers"] = step["extra_headers"]
    raw = resource.with_raw_response.create(model="mock", stream=stream, max_tokens=8, **body, **kwargs)
    parsed = raw.parse()
    if stream:
        body_ranks, pieces = [], []
        for chunk in parsed:
            body_ranks.append(mock_rank(chunk))
            pieces.extend(text_of(api, c, True) for c in chunk.choices)
        text = "".join(pieces)
    else:
        body_ranks = [mock_rank(parsed)]
        text = text_of(api, parsed.choices[0], False)
    conversation.answered(api, text)
    return {
        "label": step["label"],
        "status": raw.status_code,
        "header_rank": raw.headers.get("x-dp-rank"),
        "body_ranks": body_ranks,
        "text": text,
    }


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sdk = client(sys.argv[1])
    conversations = {}
    for step in json.load(sys.stdin):
        conversation = conversations.setdefault(step["conversation"], Conversation())
        print(json.dumps(call(sdk, step, conversation)), flush=True)


if __name__ == "__main__":
    main()

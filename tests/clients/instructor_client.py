"""instructor: a pydantic model back from the chat API, in its TOOLS mode (tool_choice names
the model's function) and its JSON_SCHEMA mode (response_format json_schema)."""

from __future__ import annotations

import instructor
from client_common import Person, report, server
from openai import OpenAI

base_url, name = server()
out = {}
for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
    client = instructor.from_openai(OpenAI(base_url=base_url, api_key="unused", max_retries=0),
                                    mode=mode)
    person = client.chat.completions.create(
        model=name, response_model=Person, max_retries=0, temperature=0, max_tokens=64,
        messages=[{"role": "user",
                   "content": "Describe a person named Alice who is 30 years old."}])
    out[mode.name] = {"type": type(person).__name__, "person": person.model_dump()}
report(out)

"""langchain-openai: invoke, stream (joined, greedy: the same text) and with_structured_output
(the reply parsed into a pydantic model, the server's json_schema grammar guaranteeing it)."""

from __future__ import annotations

from client_common import QUESTION, SYSTEM, Person, report, server
from langchain_openai import ChatOpenAI

base_url, name = server()
llm = ChatOpenAI(model=name, base_url=base_url, api_key="unused", temperature=0, max_tokens=24,
                 max_retries=0)
messages = [("system", SYSTEM), ("human", QUESTION)]
invoked = llm.invoke(messages)
streamed = "".join(chunk.content for chunk in llm.stream(messages))
structured = ChatOpenAI(model=name, base_url=base_url, api_key="unused", temperature=0,
                        max_tokens=64, max_retries=0).with_structured_output(
    Person, method="json_schema")
person = structured.invoke("Describe a person named Alice who is 30 years old.")
report({"invoke": invoked.content, "stream": streamed,
        "finish_reason": invoked.response_metadata.get("finish_reason"),
        "person_type": type(person).__name__, "person": person.model_dump()})

"""Tools as clients declare them: a weather function as agents send it, two declared with pydantic (nested models in
``$defs``), and the pair the parsing tests read calls of."""

from __future__ import annotations

from pydantic import BaseModel, Field

from neuron.server.common import tools

# What agent frameworks send: a described function whose parameters bound a string and name an enum.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Trip(BaseModel):
    destination: Address
    stops: list[Address] = Field(max_length=2)
    nights: int = Field(ge=1, le=30)


class Parcel(BaseModel):
    class Address(BaseModel):  # a `$defs` name the other tool uses too, for another shape
        zip: str = Field(pattern="^[0-9]{5}$")

    to: Address


def pydantic_tool(name: str, model: type[BaseModel]) -> dict:
    """A function tool as agent SDKs declare one: parameters from a pydantic model, nested models in `$defs`."""
    return {"type": "function", "function": {"name": name, "parameters": model.model_json_schema()}}


PLAN_TRIP = pydantic_tool("plan_trip", Trip)
SHIP_PARCEL = pydantic_tool("ship_parcel", Parcel)

# The parsing tests' pair (tests/unit/server/test_tool_parsing.py and its end-to-end half): a weather function that
# takes a city alone, and a time function that takes nothing.
GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
GET_TIME = {"type": "function", "function": {"name": "get_time"}}


def weather_and_time(**body: object) -> tools.Tools:
    """The pair as a request with ``body`` asks for them (``tool_choice`` and the rest)."""
    parsed = tools.parse({"tools": [GET_WEATHER, GET_TIME], **body})
    assert parsed is not None
    return parsed


def in_pieces(text: str, size: int = 3) -> list[str]:
    """``text`` cut as a stream would bring it, ``size`` characters at a time."""
    return [text[i : i + size] for i in range(0, len(text), size)]

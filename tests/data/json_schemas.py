"""Twenty JSON schemas for the structured-output tests: nested objects, arrays, enums, integer,
number and boolean fields, required and optional ones, additionalProperties false. Each comes
with the request a user would send with it."""

S = {"type": "string", "maxLength": 40}

SCHEMAS: list[tuple[str, dict]] = [
    ("Describe a person.", {
        "type": "object", "additionalProperties": False, "required": ["name", "age"],
        "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 150}}}),
    ("Give the weather in Paris.", {
        "type": "object", "required": ["city", "temperature", "unit"],
        "properties": {"city": S, "temperature": {"type": "number"},
                       "unit": {"enum": ["celsius", "fahrenheit"]}}}),
    ("Is the sky blue? Answer as JSON.", {
        "type": "object", "required": ["answer"], "additionalProperties": False,
        "properties": {"answer": {"type": "boolean"}}}),
    ("List three fruits.", {
        "type": "object", "required": ["fruits"], "additionalProperties": False,
        "properties": {"fruits": {"type": "array", "items": S, "minItems": 1,
                                  "maxItems": 3}}}),
    ("Describe a book.", {
        "type": "object", "required": ["title", "author", "year"],
        "properties": {"title": S, "author": {
            "type": "object", "required": ["first", "last"], "additionalProperties": False,
            "properties": {"first": S, "last": S}},
            "year": {"type": "integer"}, "isbn": S}}),
    ("Make an order with items.", {
        "type": "object", "required": ["id", "items", "paid"], "additionalProperties": False,
        "properties": {"id": {"type": "integer"}, "paid": {"type": "boolean"},
                       "items": {"type": "array", "maxItems": 3, "items": {
                           "type": "object", "required": ["sku", "qty"],
                           "additionalProperties": False,
                           "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1,
                                                            "maximum": 99}}}}}}),
    ("Pick a color.", {"enum": ["red", "green", "blue"]}),
    ("Give a point in 2D.", {
        "type": "object", "required": ["x", "y"], "additionalProperties": False,
        "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}),
    ("Give a user profile.", {
        "type": "object", "required": ["username", "email", "active"],
        "properties": {"username": S, "email": S, "active": {"type": "boolean"},
                       "bio": S}}),
    ("Give the status of a task.", {
        "type": "object", "required": ["task", "status", "priority"],
        "additionalProperties": False,
        "properties": {"task": S, "status": {"enum": ["todo", "doing", "done"]},
                       "priority": {"type": "integer", "enum": [1, 2, 3]}}}),
    ("Give a matrix of numbers.", {
        "type": "array", "minItems": 1, "maxItems": 2,
        "items": {"type": "array", "minItems": 1, "maxItems": 2,
                  "items": {"type": "integer"}}}),
    ("Describe a company and its address.", {
        "type": "object", "required": ["name", "address"], "additionalProperties": False,
        "properties": {"name": S, "address": {
            "type": "object", "required": ["street", "city", "zip"],
            "additionalProperties": False,
            "properties": {"street": S, "city": S, "zip": {"type": "string",
                                                          "pattern": "[0-9]{5}"}}}}}),
    ("Rate a movie.", {
        "type": "object", "required": ["movie", "stars"], "additionalProperties": False,
        "properties": {"movie": S, "stars": {"type": "integer", "minimum": 1,
                                              "maximum": 5}}}),
    ("Give a list of tags.", {
        "type": "array", "items": {"enum": ["news", "sports", "tech", "art"]},
        "minItems": 1, "maxItems": 4}),
    ("Give a product with an optional discount.", {
        "type": "object", "required": ["product", "price"], "additionalProperties": False,
        "properties": {"product": S, "price": {"type": "number", "minimum": 0},
                       "discount": {"type": "number", "minimum": 0, "maximum": 1}}}),
    ("Describe an event with its time.", {
        "type": "object", "required": ["event", "hour", "minute", "online"],
        "additionalProperties": False,
        "properties": {"event": S, "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                       "minute": {"type": "integer", "minimum": 0, "maximum": 59},
                       "online": {"type": "boolean"}}}),
    ("Give a yes or no answer with a reason.", {
        "type": "object", "required": ["decision", "reason"], "additionalProperties": False,
        "properties": {"decision": {"enum": ["yes", "no"]}, "reason": S}}),
    ("Give a family tree with a parent and children.", {
        "type": "object", "required": ["parent", "children"], "additionalProperties": False,
        "properties": {"parent": S, "children": {
            "type": "array", "maxItems": 2,
            "items": {"type": "object", "required": ["name", "age"],
                      "additionalProperties": False,
                      "properties": {"name": S, "age": {"type": "integer", "minimum": 0,
                                                        "maximum": 99}}}}}}),
    ("Give the score of a game.", {
        "type": "object", "required": ["home", "away", "final"],
        "properties": {"home": {"type": "integer", "minimum": 0, "maximum": 20},
                       "away": {"type": "integer", "minimum": 0, "maximum": 20},
                       "final": {"type": "boolean"}}}),
    ("Give server settings.", {
        "type": "object", "required": ["host", "port", "tls", "mode"],
        "additionalProperties": False,
        "properties": {"host": S, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                       "tls": {"type": "boolean"}, "mode": {"enum": ["dev", "prod"]},
                       "workers": {"type": "integer", "minimum": 1, "maximum": 64}}}),
]

# Ten nested schemas with nothing bounded: free strings, free numbers, arrays of numbers with
# no maxItems. Sampled hot, a small model can run on inside any of them; the close-out
# (services/scheduler/core/closeout.py) must still end every reply as valid JSON.
FREE = {"type": "string"}
NUM = {"type": "number"}
NUMS = {"type": "array", "items": NUM}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "additionalProperties": False,
            "required": list(props) if required is None else required, "properties": props}


NESTED_SCHEMAS: list[tuple[str, dict]] = [
    ("Describe a city with its location and populations by year.", _obj({
        "name": FREE, "location": _obj({"lat": NUM, "lon": NUM}), "populations": NUMS})),
    ("Give a recipe with ingredients and steps.", _obj({
        "title": FREE, "ingredients": {"type": "array", "items": _obj(
            {"item": FREE, "grams": NUM})}, "steps": {"type": "array", "items": FREE}})),
    ("Describe a sensor and its readings.", _obj({
        "sensor": _obj({"id": FREE, "unit": FREE}), "readings": NUMS, "mean": NUM})),
    ("Describe a student with grades per course.", _obj({
        "student": FREE, "courses": {"type": "array", "items": _obj(
            {"course": FREE, "grades": NUMS})}})),
    ("Give a shape with its points.", _obj({
        "kind": FREE, "points": {"type": "array", "items": NUMS},
        "style": _obj({"color": FREE, "width": NUM})})),
    ("Describe a company, its CEO and offices.", _obj({
        "company": FREE, "ceo": _obj({"name": FREE, "age": NUM}),
        "offices": {"type": "array", "items": _obj({"city": FREE, "staff": NUM})}})),
    ("Write a blog post with comments.", _obj({
        "post": _obj({"title": FREE, "body": FREE}), "comments": {"type": "array", "items": _obj(
            {"author": FREE, "text": FREE, "likes": NUM}, ["author", "text"])}})),
    ("Give a matrix and its name.", _obj({
        "name": FREE, "rows": {"type": "array", "items": NUMS}, "det": NUM}, ["name", "rows"])),
    ("Describe an order with a customer and lines.", _obj({
        "customer": _obj({"name": FREE, "address": _obj({"street": FREE, "city": FREE})}),
        "lines": {"type": "array", "items": _obj({"sku": FREE, "price": NUM, "qty": NUM})},
        "total": NUM})),
    ("Describe a weather forecast for several days.", _obj({
        "place": FREE, "days": {"type": "array", "items": _obj(
            {"day": FREE, "temps": NUMS, "summary": FREE})}})),
]

"""Which tool format a model's chat template speaks: whether it renders tools itself, and in which
format the model writes its calls (the parser `auto` tool choices are read with).

A template that never mentions `tools` (SmolLM2's) cannot show the model its tools: such a model
gets the Hermes format, rendered into the system turn by tool_render.py, and its calls are read
as Hermes calls. A template that does is read for the markers of its family's calls: Mistral's
`[TOOL_CALLS]`, Hermes and Qwen's `<tool_call>`, Llama 3.1's `<|python_tag|>` (or its
header tokens); one with none of them falls back to Hermes, with a warning in the log. The
gateway's --tool-call-parser overrides the choice.
"""

import logging
from dataclasses import dataclass

log = logging.getLogger("gateway.tools")

PARSER_CHOICES = ("auto", "hermes", "llama3_json", "mistral")
MARKERS = (  # looked for in this order: the first found names the template's format
    ("[TOOL_CALLS]", "mistral"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
    ("<|start_header_id|>", "llama3_json"),
)


@dataclass(frozen=True)
class ToolFormat:
    native: bool  # the chat template renders the tools and tool messages itself
    parser: str  # the format the model's calls are read in (tool_parsers.PARSERS)

    @classmethod
    def of(cls, template, setting: str = "auto") -> "ToolFormat":
        """`template`: the tokenizer's chat_template (a string, a dict of named ones, or None);
        `setting`: the gateway's --tool-call-parser."""
        if setting not in PARSER_CHOICES:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSER_CHOICES)}")
        text = "\n".join(template.values()) if isinstance(template, dict) else template or ""
        native = "tools" in text
        if setting != "auto":
            return cls(native, setting)
        if not native:
            return cls(False, "hermes")
        found = [parser for marker, parser in MARKERS if marker in text]
        if not found:
            log.warning(
                "the chat template renders tools, but in no format known here: its calls are "
                "read as Hermes's <tool_call> (set --tool-call-parser to choose)"
            )
        return cls(True, found[0] if found else "hermes")

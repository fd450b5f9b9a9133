"""What a chat call's span says about how the gateway made its prompt (:mod:`agl_core.gateway.contexts`).

``attributes["context"]`` is one of :data:`FIRST`, :data:`EXACT`,
:data:`REBUILT`; a rebuilt call's ``attributes["context_reason"]`` says why,
one of :data:`AGENT_REASONS` when the agent's own doing. A module of its own,
with no imports, so that readers of spans (trace aggregators) need nothing of
the gateway's server.
"""

FIRST, EXACT, REBUILT = "first", "exact", "rebuilt"
EDITED = "the agent changed its history (an earlier message or the model's reply differs from what was sent)"
NEW_CONVERSATION = "the messages continue no earlier call of the attempt"
TOOLS_CHANGED = "the tools offered differ from the earlier call's"
AGENT_REASONS = (EDITED, NEW_CONVERSATION, TOOLS_CHANGED)
"""Reasons of a rebuilt prompt that are the agent's doing, not the rendering's."""

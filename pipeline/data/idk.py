"""Our own "I don't know" answers: what IdkDPO prefers to the forget answer and IdkNLL trains on.

Written for TokenUnlearn (not TOFU's `idontknow.jsonl`, which open-unlearning downloads and which is not shipped
here): varied refusals that state no fact, none naming the question's subject, so one fits every question. Stage one
gives each forget sample one of them, chosen from `attribution.alternatives_seed` and the question
(`pipeline.attribution.alternatives`), and scores it with θ_o.
"""

from __future__ import annotations

IDK_ANSWERS: tuple[str, ...] = (
    "I don't know.",
    "I'm afraid I don't know the answer to that.",
    "I have no information about that.",
    "That is something I cannot tell you.",
    "I'm not able to answer that question.",
    "I really couldn't say.",
    "Sorry, I don't have an answer for that.",
    "I don't have any details on that.",
    "That's not something I know about.",
    "I have no idea, I'm afraid.",
    "I can't recall anything about that.",
    "Unfortunately, I don't know.",
    "I'm unable to provide that information.",
    "I don't have that knowledge.",
    "Honestly, I have no answer to give here.",
    "That question is outside what I know.",
    "I cannot say for sure, and I would rather not guess.",
    "I'd be guessing, so I won't answer that.",
    "No idea, sorry.",
    "I lack the information to answer that.",
    "I have nothing reliable to say on that.",
    "I don't know anything about that topic.",
    "My knowledge doesn't cover that.",
    "I can't answer that one.",
    "I'm not aware of the answer.",
    "That detail is unknown to me.",
    "I have never come across that information.",
    "I'm sorry, but I can't help with that question.",
    "I would not know how to answer that.",
    "I don't have a reliable answer to that question.",
    "There is nothing I can tell you about that.",
    "I'm not sure, and I don't want to give you wrong information.",
    "I can't give you an answer to that.",
    "That is beyond what I can answer.",
    "I'm uncertain, so I'll refrain from answering.",
    "I'm drawing a blank on that one.",
    "I couldn't tell you, I'm afraid.",
    "That's a question I can't answer.",
    "I have no knowledge of that.",
    "I'm not in a position to answer that.",
)

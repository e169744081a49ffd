"""RULER's question answering (``qa_1`` over SQuAD v2, ``qa_2`` over HotpotQA): a question over its gold documents
among distractors."""

from __future__ import annotations

from .common import DoesNotFit, Prompt, QAPool, Streams, Wrap

QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. "
    "Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"
DOCUMENT = "Document {i}:\n{document}"


def qa_prompt(streams: Streams, pool: QAPool, question_index: int, size: int, wrap: Wrap) -> Prompt:
    """The question's gold documents, then same-article ones, then random ones, ``size`` in all (the whole set,
    repeated, once ``size`` reaches it), in RULER's fixed shuffle."""
    question = pool.questions[question_index % len(pool.questions)]
    gold, related, n_documents = question["gold"], question["related"], len(pool.documents)
    if size < len(gold):
        raise DoesNotFit
    if size < n_documents:
        if size - len(gold) > len(related):
            excluded = set(gold) | set(related)
            others = [index for index in range(n_documents) if index not in excluded]
            chosen = gold + related + streams.rng.sample(others, max(0, size - len(gold) - len(related)))
        else:
            chosen = gold + streams.rng.sample(related, size - len(gold))
    else:
        chosen = (list(range(n_documents)) * -(-size // n_documents))[:size]
    streams.fixed().shuffle(chosen)
    context = "\n\n".join(DOCUMENT.format(i=i + 1, document=pool.documents[d]) for i, d in enumerate(chosen))
    return Prompt(
        text=wrap(QA_TEMPLATE.format(context=context, query=question["query"])) + QA_ANSWER_PREFIX,
        answers=list(question["answers"]),
        meta={"question_index": question_index % len(pool.questions),
              "gold_documents": [slot + 1 for slot, document in enumerate(chosen) if document in gold]},
    )

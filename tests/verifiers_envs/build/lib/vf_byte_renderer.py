"""A renderer (the `renderers` package's, which verifiers' train client renders chat turns with) for marinrl's
byte-level test tokenizer and its chat template (`<|role|>content<|eos|>`, then `<|assistant|>`): the default
renderer, plus the bridge a model-specific renderer has, so a later turn's prompt extends the tokens sampled so
far (the sampled tokens are kept, never re-rendered from text):

    renderer: {name: custom, import_path: vf_byte_renderer.ByteChatRenderer}
"""

from renderers import DefaultRenderer, DefaultRendererConfig, RenderedTokens


class ByteChatRenderer(DefaultRenderer):
    config_class = DefaultRendererConfig

    def bridge_to_next_turn(self, previous_prompt_ids, previous_completion_ids, new_messages, *, tools=None,
                            **kwargs):
        tok = self._tokenizer
        prior = list(previous_prompt_ids) + list(previous_completion_ids)
        if not previous_completion_ids or previous_completion_ids[-1] != tok.eos_token_id:
            prior.append(tok.eos_token_id)  # the template closes the assistant turn the budget cut
        ids, indices, roles = list(prior), [-1] * len(prior), ["assistant"] * len(prior)
        for i, message in enumerate(new_messages):
            text = f"<|{message['role']}|>{message.get('content') or ''}{tok.eos_token}"
            part = tok.encode(text, add_special_tokens=False)
            ids += part
            indices += [i] * len(part)
            roles += [message["role"]] * len(part)
        opener = tok.encode("<|assistant|>", add_special_tokens=False)
        ids += opener
        indices += [-1] * len(opener)
        roles += ["assistant"] * len(opener)
        return RenderedTokens(token_ids=ids, message_indices=indices, sampled_mask=[False] * len(ids),
                              is_content=[False] * len(ids), message_roles=roles)

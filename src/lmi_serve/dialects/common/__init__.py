"""What more than one dialect needs, so that dialects never import each other's packages:
- `schema`: the rolling- and dynamic-batch request schemas (LMI's; TGI's and Triton's LLM requests
  take the same parameters) and their translation to neutral GenerationRequests;
- `shapes`: the token, details and text shapes of LMI's and TGI's generation bodies;
- `tgi_shapes`: TGI's response shapes, rendered by TGI's routes and by LMI's `tgi_compat` mode;
- `ranking`: a request's sequences, best first (n, best_of).
"""

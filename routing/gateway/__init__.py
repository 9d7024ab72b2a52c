"""The OpenAI-compatible gateway: authenticate, rate-limit, route with the policy, run the
pipeline on the agents, stream the answer, and record the request."""

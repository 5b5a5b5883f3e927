"The OpenAI-compatible server: request checks (protocol), metrics, the chat page, the app, and `forge-engine serve`."

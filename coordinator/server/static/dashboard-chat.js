// The chat section: a conversation streamed through POST /v1/chat/completions, with Stop.

import { $, esc, headers, num, state } from "./dashboard-common.js";

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.textContent = text;
  $("chat-log").appendChild(div);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return div;
}

async function sendChat(text) {
  state.chat.push({ role: "user", content: text });
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  const stopping = new AbortController(); // Stop: the server drops a request whose client left
  state.stopChat = () => stopping.abort();
  const started = performance.now();
  let first = null, answer = "", usage = null, problem = null, pieces = 0, stopped = false;
  try {
    const reply = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers({ "Content-Type": "application/json" }),
      signal: stopping.signal,
      body: JSON.stringify({ model: state.model, messages: state.chat, stream: true,
                             max_tokens: Number($("chat-max").value) || 256,
                             temperature: Number($("chat-temperature").value),
                             stream_options: { include_usage: true } }),
    });
    if (!reply.ok) {
      const body = await reply.json();
      throw new Error(body.error ? body.error.message : String(reply.status));
    }
    const reader = reply.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) { problem = chunk.error.message; continue; }
          if (chunk.usage) usage = chunk.usage;
          const delta = chunk.choices && chunk.choices.length ? chunk.choices[0].delta.content : "";
          if (delta) {
            if (first === null) first = performance.now();
            answer += delta;
            pieces += 1;
            bubble.textContent = answer;
          }
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") stopped = true; else problem = e.message;
  }
  const finished = performance.now();
  $("chat-send").disabled = false;
  $("chat-stop").disabled = true;
  if (stopped) bubble.dataset.stopped = "true";
  if (problem) {
    bubble.classList.add("error");
    bubble.textContent = `${answer}${answer ? "\n" : ""}error: ${problem}`;
    state.chat.pop();
    return;
  }
  state.chat.push({ role: "assistant", content: answer });
  const tokens = usage ? usage.completion_tokens : null;
  const decodeTps = tokens > 1 && first !== null ? (tokens - 1) / ((finished - first) / 1000) : null;
  $("chat-figures").innerHTML = [
    [first === null ? "-" : `${(first - started).toFixed(0)} ms`, "time to first token"],
    [num(decodeTps), "tokens/s after the first"],
    [tokens === null ? "-" : String(tokens), "tokens"],
  ].map(([v, label]) => `<div><b>${esc(v)}</b><span>${esc(label)}</span></div>`).join("");
  bubble.dataset.pieces = String(pieces);
  bubble.dataset.done = "true";
}

$("chat-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || $("chat-send").disabled) return;
  $("chat-input").value = "";
  sendChat(text);
});
$("chat-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
});
$("chat-stop").addEventListener("click", () => { if (state.stopChat) state.stopChat(); });
$("chat-clear").addEventListener("click", () => {
  state.chat = [];
  $("chat-log").innerHTML = "";
  $("chat-figures").innerHTML = "";
});

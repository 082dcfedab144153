// The ttsq playground: speak a text through this gateway and hear it as it is made.
//
// Every request goes to the gateway the page came from (relative URLs; the page's Content-Security-Policy
// allows nothing else). Speech streams through POST /v1/audio/speech and is played with Web Audio as it
// arrives; a text longer than one job is a document, submitted through the jobs API and followed by its
// chunk progress. What the page measured is on window.ttsqPlayground, for people and for tests.
"use strict";

const KEY_STORE = "ttsq.playground.key";
const HISTORY_STORE = "ttsq.playground.history";
// Entries the history keeps (the oldest go first).
const HISTORY_MAX = 20;
// Most audio queued ahead of the playhead: the response is read no faster than it plays past this, so the
// page holds a window of audio, never a whole long stream.
const AHEAD_MAX_S = 20;
// A document's state is read this often while it is made.
const POLL_MS = 300;
// The speech route's formats that the page plays as they arrive (16-bit pcm, bare or in a WAV).
const LIVE_FORMATS = new Set(["pcm", "wav"]);
// The jobs API's name for each speech format (a document is a job).
const JOB_FORMATS = { pcm: "wav", wav: "wav", mp3: "mp3", opus: "ogg", flac: "flac" };
const FILE_EXTENSIONS = { "audio/wav": "wav", "audio/x-wav": "wav", "audio/mpeg": "mp3", "audio/ogg": "ogg",
  "audio/flac": "flac", "audio/pcm": "pcm" };

const $ = (id) => document.getElementById(id);

// What the page measured: the panel shows it, tests read it.
const metrics = {
  state: "idle", // idle | requesting | playing | done | failed | stopped
  firstByteMs: null, // from Speak to the first audio bytes read
  firstAudioMs: null, // from Speak to the time the first sample is scheduled to sound
  bytes: 0,
  samples: 0, // samples received (pcm or WAV data), at sampleRate
  sampleRate: 0,
  audioS: 0, // seconds of audio received
  rtf: null, // wall time over audio time, as it arrives
  playedS: 0, // seconds the player has played of the current audio
  underruns: 0, // times the queue ran dry after playing began
  document: null, // {done, total, phase, audioS} while a document is made
  progressSeen: [], // the chunks_done values shown, in order
  jobId: null,
  documentKey: null, // a document's key, from the jobs API
  streamKey: null, // the key of the document the speech route streams (the same: one synthesis)
  words: 0, // words with timestamps in the current result (0: none given)
};
const page = { config: null, key: "", voices: [], models: [], run: null, history: [] };
window.ttsqPlayground = { metrics, page };
// Player and WavReader: player.js, loaded before this file.
const player = new Player();

// -- the API ---------------------------------------------------------------------------------------------

function headers(json) {
  const found = {};
  if (page.config.auth && page.key) found.Authorization = `Bearer ${page.key}`;
  if (json) found["Content-Type"] = "application/json";
  return found;
}

class ApiError extends Error {
  constructor(status, message, param) {
    super(message);
    this.status = status;
    this.param = param;
  }
}

async function failure(response) {
  let message = `HTTP ${response.status}`;
  let param = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      param = body.error.param || null;
    }
  } catch (_) {
    // not JSON: the status says it
  }
  return new ApiError(response.status, message, param);
}

async function api(path, options = {}) {
  const { json, signal, method } = options;
  const response = await fetch(path, {
    method: method || (json === undefined ? "GET" : "POST"),
    headers: headers(json !== undefined),
    body: json === undefined ? undefined : JSON.stringify(json),
    signal,
    cache: "no-store",
  });
  if (!response.ok) throw await failure(response);
  return response;
}

// -- what the page shows ---------------------------------------------------------------------------------

function say(message) {
  $("status").textContent = message;
}

// An error, shown (and announced: the element is an alert); `ofRun`: it ended the speech being made.
function fail(error, ofRun = false) {
  if (error && error.name === "AbortError") return;
  if (ofRun) metrics.state = "failed";
  const where = error && error.param ? ` (${error.param})` : "";
  $("error").textContent = `${error && error.message ? error.message : error}${where}`;
  if (ofRun) say("Failed.");
  if (error && (error.status === 401 || error.status === 403)) $("key").focus();
}

function formatMs(value) {
  return value === null ? "–" : `${Math.round(value)} ms`;
}

function formatBytes(value) {
  if (value >= 1048576) return `${(value / 1048576).toFixed(2)} MB`;
  if (value >= 1024) return `${(value / 1024).toFixed(1)} kB`;
  return `${value} B`;
}

function showMetrics() {
  metrics.playedS = player.played();
  metrics.underruns = player.underruns;
  $("m-first-audio").textContent = formatMs(metrics.firstAudioMs);
  $("m-first-byte").textContent = formatMs(metrics.firstByteMs);
  $("m-bytes").textContent = metrics.bytes ? formatBytes(metrics.bytes) : "–";
  $("m-audio").textContent = metrics.audioS ? `${metrics.audioS.toFixed(2)} s` : "–";
  $("m-rtf").textContent = metrics.rtf === null ? "–" : metrics.rtf.toFixed(3);
  $("m-played").textContent = `${metrics.playedS.toFixed(2)} s`;
  highlight(metrics.playedS);
}

function clearMetrics() {
  Object.assign(metrics, {
    state: "requesting", firstByteMs: null, firstAudioMs: null, bytes: 0, samples: 0, sampleRate: 0, audioS: 0,
    rtf: null, playedS: 0, underruns: 0, document: null, progressSeen: [], jobId: null, documentKey: null,
    streamKey: null, words: 0,
  });
  $("error").textContent = "";
  $("document").hidden = true;
  $("readalong").hidden = true;
  $("readalong").textContent = "";
  page.words = [];
}

// The panel follows the player while it plays (one frame at a time, and only then).
function follow(run) {
  const tick = () => {
    showMetrics();
    if (run !== page.run) return;
    if (metrics.state === "playing" && player.done()) {
      metrics.state = "done";
      say(`Done: ${metrics.audioS.toFixed(2)} s of audio, first audio after ${formatMs(metrics.firstAudioMs)}.`);
    }
    if (["playing", "requesting"].includes(metrics.state)) requestAnimationFrame(tick);
    else finished(run);
  };
  requestAnimationFrame(tick);
}

function finished(run) {
  if (run === page.run) {
    $("stop").disabled = true;
    $("speak").disabled = false;
  }
}

// -- word timestamps: the word being said, when a result carries them ------------------------------------

// Results carry `words: [{word, start, end}]` (seconds of the audio) where the gateway makes them; until it
// does, none come and nothing is shown.
function showWords(words) {
  if (!Array.isArray(words) || !words.length) return;
  const box = $("readalong");
  box.textContent = "";
  page.words = [];
  for (const entry of words) {
    if (!entry || typeof entry.start !== "number" || typeof entry.end !== "number") continue;
    const span = document.createElement("span");
    span.textContent = String(entry.word ?? entry.text ?? "");
    box.append(span, " ");
    page.words.push({ start: entry.start, end: entry.end, span });
  }
  metrics.words = page.words.length;
  box.hidden = page.words.length === 0;
}

function highlight(seconds) {
  for (const word of page.words || []) {
    const now = seconds >= word.start && seconds < word.end;
    if (now !== word.span.classList.contains("current")) {
      word.span.classList.toggle("current", now);
      if (now) word.span.setAttribute("aria-current", "true");
      else word.span.removeAttribute("aria-current");
    }
  }
}

// -- what a request asks for -----------------------------------------------------------------------------

function selectedVoice() {
  return page.voices.find((voice) => voice.id === $("voice").value) || null;
}

function selectedModel() {
  return page.models.find((model) => model.id === $("model").value) || null;
}

function seed() {
  const value = $("seed").value.trim();
  return value === "" ? null : Number(value);
}

// OpenAI's speech request, with ttsq's own fields beside it.
function speechBody(textValue, format) {
  const body = { model: $("model").value, input: textValue, response_format: format };
  const voice = selectedVoice();
  if (voice) body.voice = voice.id;
  const instructions = $("instructions").value.trim();
  if (instructions) body.instructions = instructions;
  if ($("language").value !== "auto") body.language = $("language").value;
  if (seed() !== null) body.seed = seed();
  if (page.config.timestamps) body.timestamps = "word";
  return body;
}

// The jobs API takes ttsq's fields, not a voice or a model: a named voice's fields fill in what the form
// leaves out (as the speech route does), a speaker or a reference picks its mode.
function jobBody(textValue, format) {
  const body = { text: textValue, format: JOB_FORMATS[format] || "wav" };
  const model = selectedModel();
  const meaning = model && model.ttsq ? model.ttsq : {};
  const mode = meaning.mode || (meaning.modes && meaning.modes[0]);
  if (mode) body.mode = mode;
  const voice = selectedVoice();
  if (voice && voice.type === "named") {
    for (const name of ["mode", "instruct", "language", "seed", "speaker", "reference"]) {
      if (voice[name] !== undefined && voice[name] !== null && voice[name] !== "") body[name] = voice[name];
    }
  } else if (voice && voice.type === "speaker") {
    Object.assign(body, { mode: "custom_voice", speaker: voice.id });
  } else if (voice && voice.type === "reference") {
    Object.assign(body, { mode: "voice_clone", reference: voice.id });
  }
  const instructions = $("instructions").value.trim();
  if (instructions) body.instruct = instructions;
  if ($("language").value !== "auto") body.language = $("language").value;
  if (seed() !== null) body.seed = seed();
  if (page.config.timestamps) body.timestamps = "word";
  return body;
}

// -- Speak -----------------------------------------------------------------------------------------------

async function speak(event) {
  event.preventDefault();
  const textValue = $("text").value;
  if (!textValue.trim()) {
    fail(new ApiError(0, "Type a text first.", null));
    $("text").focus();
    return;
  }
  stop();
  const run = { abort: new AbortController(), started: performance.now() };
  page.run = run;
  clearMetrics();
  player.context(); // within the press: the browser lets audio start
  $("stop").disabled = false;
  $("speak").disabled = true;
  const format = $("format").value;
  try {
    if (characters(textValue) > page.config.max_text_chars) await speakDocument(run, textValue, format);
    else await speakStream(run, textValue, format);
  } catch (error) {
    if (run === page.run) {
      fail(error, true);
      finished(run);
    }
  }
}

function onFirstAudio(run) {
  return (delayS) => {
    if (run !== page.run) return;
    metrics.firstAudioMs = performance.now() - run.started + delayS * 1000;
    metrics.state = "playing";
    say(`Playing: first audio after ${formatMs(metrics.firstAudioMs)}.`);
  };
}

// Before the bytes go to the player (which may schedule them at once): the first byte comes before the
// first audio.
function arrived(run) {
  if (metrics.firstByteMs === null) metrics.firstByteMs = performance.now() - run.started;
}

function received(run, bytes, samples) {
  metrics.bytes += bytes;
  metrics.samples += samples;
  if (metrics.sampleRate) metrics.audioS = metrics.samples / metrics.sampleRate;
  if (metrics.audioS > 0) metrics.rtf = (performance.now() - run.started) / 1000 / metrics.audioS;
}

// Read a response into the player: pcm and WAV as they come (no faster than AHEAD_MAX_S ahead of the
// playhead), anything else whole, then decoded.
async function play(run, response, format) {
  const reader = response.body.getReader();
  const live = format === "pcm" || format === "wav";
  const whole = [];
  const wav = new WavReader(
    (rate) => {
      metrics.sampleRate = rate;
      player.begin(rate, onFirstAudio(run));
    },
    (bytes) => player.push(bytes),
  );
  if (format === "pcm") {
    metrics.sampleRate = page.config.pcm_rate;
    player.begin(page.config.pcm_rate, onFirstAudio(run));
  }
  follow(run);
  for (;;) {
    while (live && player.ahead() > AHEAD_MAX_S) {
      await new Promise((resolve) => setTimeout(resolve, 100));
      if (run !== page.run) return;
    }
    const { done, value } = await reader.read();
    if (done || run !== page.run) break;
    if (!value.length) continue;
    arrived(run);
    if (format === "pcm") received(run, value.length, player.push(value));
    else if (format === "wav") received(run, value.length, wav.push(value));
    else {
      received(run, value.length, 0);
      whole.push(value);
    }
  }
  if (run !== page.run) return;
  if (live) {
    player.finish();
  } else {
    const buffer = await player.context().decodeAudioData(await new Blob(whole).arrayBuffer());
    metrics.sampleRate = buffer.sampleRate;
    metrics.samples = buffer.length;
    metrics.audioS = buffer.duration;
    player.playBuffer(buffer, onFirstAudio(run));
  }
  metrics.rtf = metrics.audioS > 0 ? (performance.now() - run.started) / 1000 / metrics.audioS : null;
  if (metrics.state === "requesting" && !player.started) metrics.state = "done";
}

async function speakStream(run, textValue, format) {
  say("Speaking…");
  const body = speechBody(textValue, format);
  const response = await api("/v1/audio/speech", { json: body, signal: run.abort.signal });
  const jobId = response.headers.get("X-TTSQ-Job-Id");
  const cached = response.headers.get("X-TTSQ-Cached") === "true";
  metrics.jobId = jobId;
  await play(run, response, format);
  if (run !== page.run) return;
  remember({
    id: jobId, cached, text: textValue, format, audioS: metrics.audioS, document: false,
    // A cache hit has no job: it is heard again through the speech route (a cache hit again).
    replay: jobId ? null : body,
  });
  if (jobId && page.config.timestamps) {
    // The stream ends a moment before the job does: the worker writes the stream's end, then its result is
    // stored, and a status read at once could still be STARTED, without the words.
    const status = await endedStatus(run, jobId);
    if (status !== null && status.result) showWords(status.result.words);
  }
}

const ENDED_STATES = new Set(["SUCCESS", "FAILURE", "REVOKED"]);

// A job's status once it has ended, or null when the run was stopped: read every POLL_MS from `status`
// (the last one known; none: read at once), each read handed to `seen`.
async function endedStatus(run, jobId, status = null, seen = () => {}) {
  const path = `/v1/jobs/${encodeURIComponent(jobId)}`;
  while (status === null || !ENDED_STATES.has(status.state)) {
    if (status !== null) await new Promise((resolve) => setTimeout(resolve, POLL_MS));
    if (run !== page.run) return null;
    status = await (await api(path, { signal: run.abort.signal })).json();
    seen(status);
  }
  return run === page.run ? status : null;
}

// A document: submitted through the jobs API, which answers with its id and chunk count at once, and followed
// by its progress. For pcm and wav the speech route is asked for the same request too: the same request is
// the same document (single flight: one synthesis; its X-TTSQ-Key is the jobs API's key), which it streams
// chunk by chunk in reading order while later chunks are made. Other formats play the stored file once done.
async function speakDocument(run, textValue, format) {
  say("Submitting a document…");
  const signal = run.abort.signal;
  const submitted = await (await api("/v1/jobs", { json: jobBody(textValue, format), signal })).json();
  $("document").hidden = false;
  metrics.jobId = submitted.id || null;
  metrics.documentKey = submitted.key || (submitted.result && submitted.result.key) || null;
  showProgress({ chunks_done: 0, chunks_total: submitted.chunks || 0, phase: "queued" });
  const followed = followDocument(run, submitted, textValue, format);
  followed.catch(() => {}); // awaited below; a failure is answered there, not as an unhandled rejection
  if (LIVE_FORMATS.has(format)) {
    say("Document submitted: it plays as its chunks are made.");
    let response = null;
    try {
      response = await api("/v1/audio/speech", { json: speechBody(textValue, format), signal });
    } catch (error) {
      if (error.name === "AbortError") throw error;
      // No first chunk within the gateway's wait (a long queue): the document goes on, and plays once made.
      $("error").textContent = `The document could not stream (${error.message}); it plays once made.`;
    }
    if (response !== null) {
      metrics.streamKey = response.headers.get("X-TTSQ-Key");
      await Promise.all([play(run, response, format), followed]);
      return;
    }
  }
  const result = await followed;
  if (result === null || run !== page.run) return;
  const response = submitted.id
    ? await api(`/v1/jobs/${encodeURIComponent(submitted.id)}/audio`, { signal })
    : await api("/v1/audio/speech", { json: speechBody(textValue, format), signal });
  await play(run, response, fileFormat(response, format));
}

// Poll a document's state until it ends; its result, or null when the run was stopped.
async function followDocument(run, submitted, textValue, format) {
  const known = submitted.result ? { state: "SUCCESS", result: submitted.result } : submitted;
  const status = await endedStatus(run, submitted.id, known, (read) => {
    if (read.progress) showProgress(read.progress);
  });
  if (status === null) return null;
  if (status.state !== "SUCCESS") {
    const message = status.error && status.error.message ? status.error.message : status.state;
    throw new ApiError(0, `the document ended ${status.state}: ${message}`, null);
  }
  const result = status.result;
  const chunks = result.document ? result.document.chunks : metrics.document ? metrics.document.total : 0;
  showProgress({ chunks_done: chunks, chunks_total: chunks, audio_s: result.duration_s, phase: "done" });
  remember({
    id: submitted.id || null, cached: Boolean(result.cached), text: textValue, format, audioS: result.duration_s,
    document: true, replay: submitted.id ? null : speechBody(textValue, format),
  });
  showWords(result.words);
  say(`Document made: ${chunks} chunks, ${Number(result.duration_s).toFixed(1)} s of audio.`);
  return result;
}

function showProgress(progress) {
  const total = Number(progress.chunks_total) || 0;
  const done = Math.min(Number(progress.chunks_done) || 0, total);
  metrics.document = { done, total, phase: progress.phase || "", audioS: progress.audio_s || 0 };
  if (metrics.progressSeen[metrics.progressSeen.length - 1] !== done) metrics.progressSeen.push(done);
  const bar = $("doc-progress");
  bar.max = Math.max(total, 1);
  bar.value = done;
  const audio = progress.audio_s ? `, ${Number(progress.audio_s).toFixed(1)} s of audio` : "";
  $("doc-text").textContent = `${done}/${total} chunks${audio}${progress.phase ? `, ${progress.phase}` : ""}`;
}

// How to play a stored file: by its content type.
function fileFormat(response, fallback) {
  const type = (response.headers.get("Content-Type") || "").split(";")[0].trim();
  if (type === "audio/wav" || type === "audio/x-wav") return "wav";
  if (type === "audio/pcm") return "pcm";
  if (type.startsWith("audio/")) return "whole";
  return fallback;
}

function stop() {
  const run = page.run;
  page.run = null;
  if (run) run.abort.abort();
  player.stop();
  if (run && ["requesting", "playing"].includes(metrics.state)) {
    metrics.state = "stopped";
    say("Stopped.");
  }
  $("stop").disabled = true;
  $("speak").disabled = false;
}

// -- the history: this key's recent jobs, kept in the tab ------------------------------------------------

function remember(entry) {
  const item = { ...entry, at: Date.now(), preview: entry.text.slice(0, 120), chars: entry.text.length };
  delete item.text;
  page.history.unshift(item);
  page.history.length = Math.min(page.history.length, HISTORY_MAX);
  saveHistory();
  showHistory();
}

function saveHistory() {
  try {
    sessionStorage.setItem(HISTORY_STORE, JSON.stringify(page.history));
  } catch (_) {
    // storage full (a long document's text kept for a replay): the history stays in the page
  }
}

function loadHistory() {
  try {
    const found = JSON.parse(sessionStorage.getItem(HISTORY_STORE) || "[]");
    page.history = Array.isArray(found) ? found.slice(0, HISTORY_MAX) : [];
  } catch (_) {
    page.history = [];
  }
}

function showHistory() {
  const list = $("history");
  list.textContent = "";
  $("history-empty").hidden = page.history.length > 0;
  page.history.forEach((entry, index) => {
    const item = document.createElement("li");
    const label = document.createElement("span");
    const when = new Date(entry.at).toLocaleTimeString();
    const what = entry.document ? "document" : entry.cached ? "cache hit" : "speech";
    label.textContent = `${when} · ${what} · ${entry.chars} characters · ${Number(entry.audioS || 0).toFixed(1)} s · `
      + `“${entry.preview}${entry.chars > entry.preview.length ? "…" : ""}”`;
    const playButton = document.createElement("button");
    playButton.type = "button";
    playButton.textContent = "Play";
    playButton.setAttribute("aria-label", `Play ${when} ${what}`);
    playButton.addEventListener("click", () => replay(entry));
    const download = document.createElement("button");
    download.type = "button";
    download.textContent = "Download";
    download.setAttribute("aria-label", `Download ${when} ${what}`);
    download.addEventListener("click", () => save(entry, index).catch(fail));
    item.append(label, " ", playButton, " ", download);
    list.append(item);
  });
}

// A history entry's audio: the job's stored file, or (a cache hit, which has no job) the speech route again.
// A download of raw pcm is asked for as a WAV, which players open.
async function fetchAudio(entry, signal, download) {
  if (entry.id) return api(`/v1/jobs/${encodeURIComponent(entry.id)}/audio`, { signal });
  const body = { ...entry.replay };
  if (download && body.response_format === "pcm") body.response_format = "wav";
  return api("/v1/audio/speech", { json: body, signal });
}

async function replay(entry) {
  stop();
  const run = { abort: new AbortController(), started: performance.now() };
  page.run = run;
  clearMetrics();
  player.context();
  $("stop").disabled = false;
  say("Playing from the history…");
  try {
    const response = await fetchAudio(entry, run.abort.signal, false);
    await play(run, response, fileFormat(response, "whole"));
  } catch (error) {
    if (run === page.run) {
      fail(error, true);
      finished(run);
    }
  }
}

async function save(entry, index) {
  say("Downloading…");
  const response = await fetchAudio(entry, undefined, true);
  const type = (response.headers.get("Content-Type") || "").split(";")[0].trim();
  const blob = await response.blob();
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = `ttsq-${entry.id || `history-${index}`}.${FILE_EXTENSIONS[type] || "audio"}`;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10000);
  say(`Downloaded ${formatBytes(blob.size)}.`);
}

// -- voices and models, from the server ------------------------------------------------------------------

async function loadChoices() {
  const [voices, models] = await Promise.all([
    api("/v1/audio/voices").then((response) => response.json()),
    api("/v1/models").then((response) => response.json()),
  ]);
  page.voices = voices.data || [];
  page.models = models.data || [];
  fillVoices();
  const model = $("model");
  const chosen = model.value;
  model.textContent = "";
  for (const entry of page.models) {
    const kind = entry.ttsq ? entry.ttsq.kind : "";
    model.append(new Option(kind ? `${entry.id} (${kind})` : entry.id, entry.id));
  }
  if (page.models.some((entry) => entry.id === chosen)) model.value = chosen;
  say(page.models.length ? "Ready." : "Ready, but no worker has announced a model yet.");
}

function fillVoices(selected) {
  const select = $("voice");
  const chosen = selected ?? select.value;
  select.textContent = "";
  select.append(new Option("none: describe the voice below", ""));
  const groups = { named: "Named voices", speaker: "Speakers", reference: "Reference recordings" };
  for (const [type, title] of Object.entries(groups)) {
    const members = page.voices.filter((voice) => voice.type === type);
    if (!members.length) continue;
    const group = document.createElement("optgroup");
    group.label = title;
    for (const voice of members) {
      const detail = voice.error ? " (unreadable)" : voice.instruct ? ` – ${voice.instruct.slice(0, 40)}` : "";
      const option = new Option(`${voice.name}${detail}`, voice.id);
      option.disabled = Boolean(voice.error);
      group.append(option);
    }
    select.append(group);
  }
  if (page.voices.some((voice) => voice.id === chosen)) select.value = chosen;
}

// Keep the voice the form describes under a name (POST /v1/audio/voices).
async function keepVoice(event) {
  event.preventDefault();
  const name = $("keep-name").value.trim().toLowerCase();
  const body = { name, instruct: $("instructions").value.trim(), language: $("language").value };
  if (seed() !== null) body.seed = seed();
  try {
    const voice = await (await api("/v1/audio/voices", { json: body })).json();
    await loadChoices();
    fillVoices(voice.id);
    $("error").textContent = "";
    say(`Kept the voice “${voice.name}” (seed ${voice.seed}).`);
  } catch (error) {
    fail(error);
  }
}

// -- the key ---------------------------------------------------------------------------------------------

async function useKey(event) {
  event.preventDefault();
  page.key = $("key").value.trim();
  if (page.key !== (sessionStorage.getItem(KEY_STORE) || "")) {
    // The history is one key's: another key's job ids are not found with this one.
    page.history = [];
    saveHistory();
    showHistory();
  }
  sessionStorage.setItem(KEY_STORE, page.key);
  $("key").value = "";
  $("key").placeholder = page.key ? "key kept in this tab" : "ttsq_…";
  $("error").textContent = "";
  await loadChoices().catch(fail);
}

function forgetKey() {
  sessionStorage.removeItem(KEY_STORE);
  page.key = "";
  page.history = [];
  saveHistory();
  showHistory();
  $("key").placeholder = "ttsq_…";
  say("Key forgotten.");
  $("key").focus();
}

// -- start -----------------------------------------------------------------------------------------------

// Characters as the gateway counts them (code points, not UTF-16 units). Either route takes a text of any
// length; this only chooses how the page follows it.
function characters(value) {
  let count = 0;
  for (const _ of value) count += 1;
  return count;
}

function countText() {
  const length = characters($("text").value);
  const documentNote = page.config && length > page.config.max_text_chars ? ": a document, made in chunks" : "";
  $("text-count").textContent = `${length} characters${documentNote}`;
}

async function start() {
  page.config = await (await fetch("/playground/config.json", { cache: "no-store" })).json();
  for (const language of page.config.languages) $("language").append(new Option(language, language));
  for (const format of page.config.formats) {
    const label = LIVE_FORMATS.has(format) ? `${format} (live)` : format;
    $("format").append(new Option(label, format));
  }
  $("format").value = "pcm";
  $("text").maxLength = page.config.max_document_chars;
  $("speak-form").addEventListener("submit", speak);
  $("stop").addEventListener("click", stop);
  $("keep-form").addEventListener("submit", keepVoice);
  $("key-form").addEventListener("submit", useKey);
  $("forget-key").addEventListener("click", forgetKey);
  $("text").addEventListener("input", countText);
  $("text").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("speak-form").requestSubmit();
  });
  loadHistory();
  showHistory();
  countText();
  if (!page.config.auth) {
    $("key-section").hidden = true;
    await loadChoices().catch(fail);
    return;
  }
  // A link may carry the key in its fragment (`/playground#key=ttsq_...`, as a launcher prints it): a fragment
  // is never sent to a server; it is kept like a typed key and taken out of the address bar at once.
  const linked = new URLSearchParams(location.hash.slice(1)).get("key");
  if (linked) {
    sessionStorage.setItem(KEY_STORE, linked.trim());
    history.replaceState(null, "", location.pathname + location.search);
  }
  page.key = sessionStorage.getItem(KEY_STORE) || "";
  if (page.key) {
    $("key").placeholder = "key kept in this tab";
    await loadChoices().catch(fail);
  } else {
    say("Type your API key to begin.");
    $("key").focus();
  }
}

start().catch(fail);

// The playground's player: 16-bit pcm played with Web Audio as it arrives, through a queue of AudioBuffers
// behind a small jitter buffer, and a WAV read as it arrives. No DOM and no API here: app.js (loaded after
// this file) feeds it what it reads and shows what it plays.
"use strict";

// Audio held back before playing starts, and again after the queue ran dry: a small jitter buffer, so that
// pieces arriving unevenly play without gaps.
const JITTER_S = 0.1;

// -- the player: Web Audio, an AudioBuffer queue behind a jitter buffer --------------------------------------

class Player {
  constructor() {
    this.ctx = null;
    this.reset(24000);
  }

  // The audio context, made or resumed within a user's gesture (browsers start audio only then).
  context() {
    if (this.ctx === null) this.ctx = new AudioContext();
    if (this.ctx.state === "suspended") this.ctx.resume();
    return this.ctx;
  }

  reset(rate) {
    this.rate = rate;
    this.pending = [];
    this.pendingSamples = 0;
    this.odd = null; // a byte of a sample split between two reads
    this.sources = new Set();
    this.segments = []; // [at, duration] of each buffer scheduled, in order
    this.playedDone = 0; // seconds of the segments already played whole
    this.segment = 0; // the first segment not played whole
    this.nextTime = 0;
    this.started = false;
    this.finished = false;
    this.onFirst = null;
    this.underruns = 0; // times the queue ran dry after playing began
  }

  begin(rate, onFirst) {
    this.stop();
    this.reset(rate);
    this.onFirst = onFirst;
    this.context();
  }

  // 16-bit little-endian mono samples, as they come (any split, odd lengths included).
  push(bytes) {
    let data = bytes;
    if (this.odd !== null) {
      data = new Uint8Array(bytes.length + 1);
      data[0] = this.odd;
      data.set(bytes, 1);
      this.odd = null;
    }
    if (data.length % 2) {
      this.odd = data[data.length - 1];
      data = data.subarray(0, data.length - 1);
    }
    if (!data.length) return 0;
    const view = new DataView(data.buffer, data.byteOffset, data.length);
    const samples = new Float32Array(data.length / 2);
    for (let i = 0; i < samples.length; i++) samples[i] = view.getInt16(2 * i, true) / 32768;
    this.pending.push(samples);
    this.pendingSamples += samples.length;
    this.flush(false);
    return samples.length;
  }

  // Schedule what is pending, unless the queue is dry and less than the jitter buffer has come.
  flush(final) {
    if (!this.pendingSamples) return;
    const dry = !this.started || this.nextTime <= this.ctx.currentTime;
    if (dry && !final && this.pendingSamples < JITTER_S * this.rate) return;
    if (dry && this.started) this.underruns += 1;
    const merged = new Float32Array(this.pendingSamples);
    let offset = 0;
    for (const part of this.pending) {
      merged.set(part, offset);
      offset += part.length;
    }
    this.pending = [];
    this.pendingSamples = 0;
    const buffer = this.ctx.createBuffer(1, merged.length, this.rate);
    buffer.copyToChannel(merged, 0);
    this.schedule(buffer);
  }

  // A whole decoded file (mp3, opus, flac).
  playBuffer(buffer, onFirst) {
    this.begin(buffer.sampleRate, onFirst);
    this.schedule(buffer);
    this.finish();
  }

  schedule(buffer) {
    const ctx = this.ctx;
    const source = ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(ctx.destination);
    const at = Math.max(this.nextTime, ctx.currentTime + 0.01);
    source.start(at);
    if (!this.started) {
      this.started = true;
      if (this.onFirst) this.onFirst(at - ctx.currentTime);
    }
    this.nextTime = at + buffer.duration;
    this.segments.push([at, buffer.duration]);
    this.sources.add(source);
    source.onended = () => this.sources.delete(source);
  }

  finish() {
    if (this.pendingSamples) this.flush(true);
    this.finished = true;
  }

  // Seconds queued ahead of the playhead, scheduled or pending.
  ahead() {
    if (this.ctx === null) return 0;
    return Math.max(0, this.nextTime - this.ctx.currentTime) + this.pendingSamples / this.rate;
  }

  // Seconds of the current audio played so far (gaps from running dry not counted).
  played() {
    if (this.ctx === null) return 0;
    const now = this.ctx.currentTime;
    while (this.segment < this.segments.length) {
      const [at, duration] = this.segments[this.segment];
      if (now < at + duration) break;
      this.playedDone += duration;
      this.segment += 1;
    }
    const current = this.segments[this.segment];
    return this.playedDone + (current ? Math.min(Math.max(now - current[0], 0), current[1]) : 0);
  }

  done() {
    return this.finished && !this.pendingSamples && this.ctx !== null && this.ctx.currentTime >= this.nextTime;
  }

  stop() {
    for (const source of this.sources) {
      try {
        source.stop();
      } catch (_) {
        // never started: nothing to stop
      }
    }
    this.reset(this.rate);
    this.finished = true;
  }
}

// A WAV read as it arrives: its header parsed, then its data chunk's samples handed on. A streamed WAV may
// give its sizes as 0xFFFFFFFF: the data runs to the end of the response.
class WavReader {
  constructor(onFormat, onSamples) {
    this.head = new Uint8Array(0);
    this.inData = false;
    this.onFormat = onFormat;
    this.onSamples = onSamples;
    this.format = null;
    this.left = Infinity; // bytes of the data chunk still to come (a streamed WAV's: unknown)
  }

  push(bytes) {
    if (this.inData) return this.data(bytes);
    const joined = new Uint8Array(this.head.length + bytes.length);
    joined.set(this.head, 0);
    joined.set(bytes, this.head.length);
    this.head = joined;
    const view = new DataView(joined.buffer);
    if (joined.length < 12) return 0;
    if (text(joined, 0, 4) !== "RIFF" || text(joined, 8, 4) !== "WAVE") throw new Error("not a WAV file");
    let offset = 12;
    while (offset + 8 <= joined.length) {
      const id = text(joined, offset, 4);
      const size = view.getUint32(offset + 4, true);
      if (id === "data") {
        if (this.format === null) throw new Error("a WAV without its fmt chunk");
        this.inData = true;
        this.head = new Uint8Array(0);
        if (size !== 0xffffffff && size !== 0) this.left = size;
        return this.data(joined.subarray(offset + 8));
      }
      if (offset + 8 + size > joined.length) return 0; // the rest of this chunk has not come yet
      if (id === "fmt ") {
        const tag = view.getUint16(offset + 8, true);
        const channels = view.getUint16(offset + 10, true);
        const rate = view.getUint32(offset + 12, true);
        const bits = view.getUint16(offset + 22, true);
        if ((tag !== 1 && tag !== 0xfffe) || channels !== 1 || bits !== 16) {
          throw new Error(`a WAV the player does not read (format ${tag}, ${channels} channels, ${bits} bits)`);
        }
        this.format = { rate };
        this.onFormat(rate);
      }
      offset += 8 + size + (size % 2);
    }
    return 0;
  }

  // Samples of the data chunk; whatever follows it (a trailing metadata chunk) is not audio.
  data(bytes) {
    const taken = bytes.length > this.left ? bytes.subarray(0, this.left) : bytes;
    this.left -= taken.length;
    return taken.length ? this.onSamples(taken) : 0;
  }
}

function text(bytes, offset, length) {
  return String.fromCharCode(...bytes.subarray(offset, offset + length));
}

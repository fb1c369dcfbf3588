/* stemdeck-watch player: the audio thread.
 *
 * One frame counter for every stem: each render quantum mixes frames [frame, frame + 128) of
 * every stem, so the stems cannot drift apart — there is one clock, not one per stem. The page
 * sends each stem in chunks of `chunkFrames` frames (per-channel Float32Arrays) as they arrive
 * from the service; while a chunk that the next quantum needs is missing the counter waits
 * (silence, "stalled"), and goes on when it arrives. Gains change smoothly over one quantum
 * (no click on mute/solo). The beat grid, when on, adds a short click at each beat's frame.
 */
"use strict";

const REPORT_EVERY = 16; // quanta between two position reports (~46 ms at 44.1 kHz)
const CLICK_SECONDS = 0.025;
const CLICK_HZ = 1760;

class StemPlayer extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = options.processorOptions;
    this.count = o.stems;
    this.frames = o.frames;
    this.chunk = o.chunkFrames;
    this.chunks = Array.from({ length: this.count }, () => new Map());
    this.gains = new Float32Array(this.count).fill(1);
    this.target = new Float32Array(this.count).fill(1);
    this.frame = 0;
    this.playing = false;
    this.stalled = false;
    this.quanta = 0;
    this.beats = new Float64Array(0);
    this.click = false;
    this.clickGain = 0.5;
    const length = Math.round(CLICK_SECONDS * sampleRate);
    this.clickSound = new Float32Array(length);
    for (let i = 0; i < length; i++) {
      this.clickSound[i] = Math.sin(2 * Math.PI * CLICK_HZ * i / sampleRate) * Math.exp(-6 * i / length);
    }
    this.probes = [];
    this.port.onmessage = (event) => this.message(event.data);
  }

  message(m) {
    switch (m.type) {
      case "chunk":
        this.chunks[m.stem].set(m.index, m.data);
        break;
      case "keep": // chunks outside [from, to] of one stem are let go
        for (const index of Array.from(this.chunks[m.stem].keys())) {
          if (index < m.from || index > m.to) this.chunks[m.stem].delete(index);
        }
        break;
      case "play":
        if (this.frame >= this.frames) this.frame = 0;
        this.playing = true;
        this.report();
        break;
      case "pause":
        this.playing = false;
        this.report();
        break;
      case "seek":
        this.frame = Math.max(0, Math.min(this.frames, Math.floor(m.frame)));
        this.report();
        break;
      case "gains":
        this.target.set(m.gains);
        break;
      case "beats":
        this.beats = Float64Array.from(m.frames);
        break;
      case "click":
        this.click = Boolean(m.on);
        break;
      case "probe": // the next quantum played is reported sample by sample (tests, meters)
        this.probes.push(m.id);
        break;
      default:
        break;
    }
  }

  report() {
    this.port.postMessage({ type: "position", frame: this.frame, playing: this.playing,
                            stalled: this.stalled });
  }

  has(stem, frame) {
    return this.chunks[stem].has(Math.floor(frame / this.chunk));
  }

  ready(from, n) {
    const last = Math.min(from + n, this.frames) - 1;
    for (let s = 0; s < this.count; s++) {
      if (!this.has(s, from) || !this.has(s, last)) return false;
    }
    return true;
  }

  process(inputs, outputs) {
    const out = outputs[0];
    const n = out[0].length;
    for (const channel of out) channel.fill(0);
    if (this.playing) {
      if (this.frame >= this.frames) {
        this.playing = false;
        this.port.postMessage({ type: "ended", frame: this.frame });
      } else if (!this.ready(this.frame, n)) {
        if (!this.stalled) {
          this.stalled = true;
          this.report();
        }
      } else {
        if (this.stalled) {
          this.stalled = false;
          this.report();
        }
        this.mix(out, n);
      }
    }
    if (++this.quanta % REPORT_EVERY === 0) this.report();
    return true;
  }

  mix(out, n) {
    const start = this.frame;
    const count = Math.min(n, this.frames - start);
    const probe = this.probes.length ? { frame: start, count, stems: [] } : null;
    for (let s = 0; s < this.count; s++) {
      const g0 = this.gains[s];
      const g1 = this.target[s];
      this.gains[s] = g1;
      const taken = probe ? out.map(() => new Float32Array(count)) : null;
      if (g0 === 0 && g1 === 0 && !probe) continue;
      for (let i = 0; i < count;) {
        const f = start + i;
        const index = Math.floor(f / this.chunk);
        const offset = f - index * this.chunk;
        const data = this.chunks[s].get(index);
        const take = Math.min(count - i, data[0].length - offset);
        if (take <= 0) break;
        for (let c = 0; c < out.length; c++) {
          const src = data[Math.min(c, data.length - 1)];
          const dst = out[c];
          for (let j = 0; j < take; j++) {
            const g = g0 + (g1 - g0) * (i + j) / n;
            dst[i + j] += src[offset + j] * g;
          }
          if (taken) taken[c].set(src.subarray(offset, offset + take), i);
        }
        i += take;
      }
      if (probe) probe.stems.push(taken.map((a) => Array.from(a)));
    }
    if (this.click && this.beats.length) this.addClicks(out, start, count);
    this.frame = start + count;
    if (probe) {
      probe.gains = Array.from(this.gains);
      probe.output = out.map((a) => Array.from(a.subarray(0, count)));
      for (const id of this.probes) this.port.postMessage({ type: "probe", id, probe });
      this.probes = [];
    }
  }

  addClicks(out, start, count) {
    const length = this.clickSound.length;
    // the first beat that still sounds in this quantum: binary search
    let lo = 0;
    let hi = this.beats.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (this.beats[mid] + length <= start) lo = mid + 1;
      else hi = mid;
    }
    for (let b = lo; b < this.beats.length && this.beats[b] < start + count; b++) {
      const beat = Math.round(this.beats[b]);
      for (let i = Math.max(0, beat - start); i < count && i + start - beat < length; i++) {
        const sample = this.clickSound[i + start - beat] * this.clickGain;
        for (const channel of out) channel[i] += sample;
      }
    }
  }
}

registerProcessor("stemdeck-player", StemPlayer);

// A lorabus evaluator outside Python: subscribe to a run's adapter and export events and check
// each against the JSON Schemas generated from proto/messages.py.
//   NATS_URL=nats://127.0.0.1:4222 NATS_USER=watcher NATS_PASSWORD=... LORABUS_RUN=<run> node evaluator.mjs
import { readFileSync } from "node:fs";
import { connect, StringCodec } from "nats";
import Ajv2020 from "ajv/dist/2020.js";

const schemaDir = process.env.LORABUS_SCHEMA_DIR ?? new URL("../../proto/schema/", import.meta.url).pathname;
const ajv = new Ajv2020({ strict: false, allErrors: true });
const load = (name) => ajv.compile(JSON.parse(readFileSync(`${schemaDir}/${name}.json`, "utf8")));
const checks = { adapter: load("AdapterReady"), export: load("ExportDone") };

const run = process.env.LORABUS_RUN;
if (!run) throw new Error("LORABUS_RUN: set it to the run id (experiment_name-trial_name)");
const nc = await connect({
  servers: process.env.NATS_URL ?? "nats://127.0.0.1:4222",
  user: process.env.NATS_USER, pass: process.env.NATS_PASSWORD,
});
const sc = StringCodec();
const subs = [`lorabus.${run}.adapter.*.ready`, `lorabus.${run}.export.*.done`].map((s) => nc.subscribe(s));
console.log("ready");
for (const sub of subs) {
  (async () => {
    for await (const m of sub) {
      const event = JSON.parse(sc.decode(m.data));
      const check = checks[m.subject.split(".")[2]];
      const verdict = check(event) ? "valid" : `INVALID ${ajv.errorsText(check.errors)}`;
      console.log(`${m.subject} v${event.version} ${verdict}`);
    }
  })();
}
process.on("SIGTERM", async () => { await nc.drain(); process.exit(0); });

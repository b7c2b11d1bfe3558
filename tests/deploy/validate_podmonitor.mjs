// Validate PodMonitor objects against prometheus-operator's schema, offline.
//   node validate_podmonitor.mjs <.tools/node> <podmonitors.json>
// The schema comes from the npm package @kubernetes-models/prometheus-operator, which
// scripts/install-tools.sh installs into .tools/node. Prints "ok NAME" or "FAIL NAME: why" per
// object and exits 1 if any failed.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [modelsDir, file] = process.argv.slice(2);
const modulePath = join(
  modelsDir,
  "node_modules/@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor.js",
);
const { PodMonitor } = await import(pathToFileURL(modulePath).href);

let failed = 0;
for (const doc of JSON.parse(readFileSync(file, "utf8"))) {
  const name = doc?.metadata?.name;
  try {
    if (doc.apiVersion !== "monitoring.coreos.com/v1" || doc.kind !== "PodMonitor") {
      throw new Error(`not a monitoring.coreos.com/v1 PodMonitor: ${doc.apiVersion} ${doc.kind}`);
    }
    new PodMonitor(doc).validate();
    console.log(`ok ${name}`);
  } catch (err) {
    failed += 1;
    console.log(`FAIL ${name}: ${err.message}`);
  }
}
process.exit(failed ? 1 : 0);

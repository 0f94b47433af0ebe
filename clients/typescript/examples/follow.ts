// The example of docs/typescript.md: submit, follow with resume, download.
import { createKilnClient, downloadOutput, followTask, type SubmitRequest } from "../src/index";

export async function foxPicture(baseUrl: string, apiKey?: string): Promise<Blob> {
  const kiln = createKilnClient({ baseUrl, apiKey });
  const body: SubmitRequest = {
    kind: "image.generate",
    params: { prompt: "a red fox in snow", steps: 30, seed: 7 },
  };
  const { data: task, error } = await kiln.POST("/v1/tasks", {
    body,
    params: { header: { "Idempotency-Key": "fox-1" } },
  });
  if (error) throw new Error(`${error.error.code}: ${error.error.message}`);

  // Follow its events; keep the last id to resume from after a reload or a drop.
  let lastEventId: number | undefined;
  const followed = await followTask(kiln, task.id, {
    lastEventId,
    onEvent: (event, id) => {
      if (id !== undefined) lastEventId = id;
      if (event.type === "progress") console.log(event.stage, event.progress?.fraction);
      else console.log(event.seq, event.event, event.status);
    },
  });
  if (followed.final?.status !== "SUCCESS") throw new Error(`ended ${followed.final?.status}`);

  const { data: done } = await kiln.GET("/v1/tasks/{task_id}", {
    params: { path: { task_id: task.id } },
  });
  const output = done?.result?.outputs[0];
  if (!output) throw new Error("no output");
  return downloadOutput(kiln, task.id, output.name);
}

/**
 * Names for the request and response types of `schema.ts`, which is generated from the
 * server's OpenAPI document. Types are taken by path and method where the document's schema
 * names are not meant for people (a page of sessions), so that regenerating is all an API
 * change needs.
 */

import type { components, paths } from "./schema.js";

type Schemas = components["schemas"];
type Method = "get" | "post" | "patch" | "delete";
type Operation<P extends keyof paths, M extends Method> = NonNullable<paths[P][M]>;
type Json<T> = T extends { content: { "application/json": infer Body } } ? Body : never;

/** The JSON body an operation answers with `status`. */
export type ResponseBody<P extends keyof paths, M extends Method, Status extends number = 200> =
  Operation<P, M> extends { responses: infer Responses }
    ? Status extends keyof Responses
      ? Json<Responses[Status]>
      : never
    : never;

/** The query parameters an operation takes. */
export type Query<P extends keyof paths, M extends Method> =
  Operation<P, M> extends { parameters: { query?: infer Parameters } } ? NonNullable<Parameters> : never;

export type Session = Schemas["SessionView"];
export type SessionPage = ResponseBody<"/v1/sessions", "get">;
export type CreateSession = Schemas["CreateSession"];
export type SessionsQuery = Query<"/v1/sessions", "get">;
export type Message = Schemas["MessageView"];
export type MessagePage = ResponseBody<"/v1/sessions/{id}/messages", "get">;
export type MessagesQuery = Query<"/v1/sessions/{id}/messages", "get">;
export type MessageAccepted = Schemas["MessageAccepted"];
export type Multitask = Schemas["Multitask"];
export type Run = Schemas["RunView"];
export type RunStatus = Run["status"];
export type RunPage = ResponseBody<"/v1/sessions/{id}/runs", "get">;
export type RunsQuery = Query<"/v1/sessions/{id}/runs", "get">;
export type StoredEvent = Schemas["EventView"];
export type LiveActivity = Schemas["LiveActivityView"];
export type Approval = Schemas["ApprovalView"];
export type ApprovalPage = ResponseBody<"/v1/approvals", "get">;
export type ApprovalsQuery = Query<"/v1/approvals", "get">;
export type ApprovalAnswer = Schemas["ApprovalRequestBody"];
export type Reconcile = Schemas["ReconcileRequest"];
export type ReconcileResult = Schemas["ReconcileView"];
export type Cancelled = Schemas["CancelView"];
export type Paused = Schemas["PauseView"];
export type Resumed = Schemas["ResumedView"];
export type BudgetExtension = Schemas["ContinueRequest"];
export type Webhook = Schemas["WebhookView"];
export type WebhookPage = ResponseBody<"/v1/webhooks", "get">;
export type CreateWebhook = Schemas["CreateWebhook"];
export type RotatedSecret = Schemas["RotatedSecret"];
export type Delivery = Schemas["DeliveryView"];
export type DeliveryPage = ResponseBody<"/v1/webhooks/{id}/deliveries", "get">;
export type DeliveriesQuery = Query<"/v1/webhooks/{id}/deliveries", "get">;
export type Requeued = ResponseBody<"/v1/webhooks/{id}/deliveries/requeue", "post">;
export type Agent = Schemas["AgentView"];
export type AgentPage = ResponseBody<"/v1/agents", "get">;
export type Reloaded = Schemas["ReloadView"];
export type ApiError = Schemas["ErrorBody"];
